"""The model runner: the one place that touches backbone and head tensors.

`execute(requests)` canonicalises each tenant's request, runs one backbone forward per group,
splits the features back per request and runs the heads (`vlamux.model.head_phase`): requests
whose heads share an architecture as one fused call, the others one by one in their own slots.
One tenant's failure (bad input, exception, NaN) fails that tenant's result only.

On a GPU nothing here waits for the device until a round's results are complete: inputs arrive
from pinned memory into the rollout pool (`vlamux.model.memory`), the group's work is queued on
the runner's own stream (`vlamux.model.device.Lane`), times are CUDA events, and one transfer
brings every result (and every forward_backward's finiteness) to the host, after which each
tenant's gradients are applied or dropped.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from vlamux.errors import InvalidInputError, UnknownTenantError
from vlamux.model import adapters
from vlamux.model.calibrate import GroupCurve
from vlamux.model.backbones import Backbone
from vlamux.model.batch import CanonicalBatch
from vlamux.model.device import Lane
from vlamux.model.feature import VLAFeature
from vlamux.model.fused import FusedHeads
from vlamux.model.group import ForwardBackward, Request, Result, Sample, plan_groups
from vlamux.model.head_phase import BackboneCall, HeadPhase, Round
from vlamux.model.heads import HeadSpec
from vlamux.model.memory import MemoryPools
from vlamux.model.slot import OptimizerSpec, Slot
from vlamux.model.slot_inputs import RowInputs
from vlamux.model.snapshot import PolicySnapshot

log = logging.getLogger(__name__)


@dataclass
class _Ingested:
    batch: CanonicalBatch
    rows: RowInputs

    @property
    def batch_size(self) -> int:
        return self.batch.batch_size


class ModelRunner:
    def __init__(self, backbones: Backbone | list[Backbone], max_group_rows: int | None = None,
                 fuse_heads: bool = True, priority: str = "normal", max_adapters_per_group: int | None = None):
        backbones = [backbones] if isinstance(backbones, Backbone) else list(backbones)
        if not backbones:
            raise ValueError("a model runner needs at least one backbone")
        if len({b.device for b in backbones}) > 1:
            raise ValueError(f"a model runner's backbones share one device, got {sorted({str(b.device) for b in backbones})}")
        for b in backbones:  # before any lane runs (a no-op for a backbone frozen by build_backbone)
            b.install_tenant_hooks()
        self.backbones = {b.backbone_id: b for b in backbones}
        self.default_backbone = backbones[0].backbone_id
        self.max_group_rows = max_group_rows
        if max_adapters_per_group is not None and max_adapters_per_group < 1:
            raise ValueError(f"max_adapters_per_group: at least 1 (or None: no cap), got {max_adapters_per_group}")
        self.max_adapters_per_group = max_adapters_per_group
        self.group_curves: dict[str, GroupCurve] = {}  # learned caps, per backbone (`calibrate`)
        self.slots: dict[str, Slot] = {}
        self.pools = MemoryPools(backbones[0].device)  # this runner's (its service's) rollout pool
        self.fused = FusedHeads() if fuse_heads else None
        self.heads = HeadPhase(self.slots, self.fused, Lane(backbones[0].device, backbones[0].dtype, priority))
        # adapter tenants' training calls: how many, and the activations their backward kept
        self.adapter_stats = {"groups": 0, "last_activation_bytes": 0, "peak_activation_bytes": 0,
                              "max_adapters_per_call": 0}

    @property
    def lane(self) -> Lane:
        """The runner's stream, marks and precision (`vlamux.model.device`): the backbone's and the heads'."""
        return self.heads.lane

    @lane.setter
    def lane(self, lane: Lane) -> None:
        self.heads.lane = lane

    @property
    def fuse_heads(self) -> bool:
        return self.fused is not None

    # ---- slots ----------------------------------------------------------------------------------
    def create_slot(self, tenant: str, head_spec: HeadSpec, optim: OptimizerSpec | None = None, seed: int = 0,
                    backbone_id: str | None = None) -> Slot:
        """A new tenant's slot; a head spec that names a LeRobot checkpoint (`heads.lerobot.import_spec`)
        imports it (`import_lerobot`), onto `backbone_id` when given."""
        from vlamux.model.heads.lerobot import checkpoint_of

        if checkpoint_of(head_spec) is not None:
            return self.import_lerobot(tenant, checkpoint_of(head_spec), optim, seed, backbone_id)
        backbone = self._backbone(backbone_id or self.default_backbone)
        return self.add_slot(Slot(tenant, head_spec, backbone.meta, optim, seed, backbone.device,
                                  **self.adapter_targets(backbone.backbone_id)))

    def import_lerobot(self, tenant: str, ckpt_dir, optim: OptimizerSpec | None = None, seed: int = 0,
                       backbone_id: str | None = None) -> Slot:
        """A tenant from a LeRobot checkpoint (SmolVLA, π0, π0.5): its expert and statistics in a slot on
        the backbone that holds the checkpoint's VLM (the same tensors, by content hash; else refused)."""
        from vlamux.model.vla.checkpoint import LeRobotCheckpoint
        from vlamux.model.vla.tenant import backbone_for, imported_slot

        if tenant in self.slots:
            raise ValueError(f"tenant {tenant!r} already has a slot")
        ckpt = LeRobotCheckpoint.read(ckpt_dir, vlm=False)  # the VLM is the backbone's: only hashed
        among = [self._backbone(backbone_id)] if backbone_id else list(self.backbones.values())
        backbone = backbone_for(ckpt, among)
        return self.add_slot(imported_slot(tenant, ckpt, backbone, optim, seed))

    def adapter_targets(self, backbone_id: str) -> dict:
        """What a slot with an adapter or query tokens needs to know of its backbone (Slot's keyword
        arguments)."""
        backbone = self._backbone(backbone_id)
        return {"adaptable": backbone.adaptable(), "lora_default": backbone.LORA_DEFAULT,
                "query_init": backbone.query_init()}

    def add_slot(self, slot: Slot) -> Slot:
        if slot.tenant in self.slots:
            raise ValueError(f"tenant {slot.tenant!r} already has a slot")
        backbone = self._backbone(slot.backbone_id)
        depth = backbone.meta.n_layers
        if slot.head_spec.feature_layers > depth:
            raise ValueError(f"head spec: feature_layers={slot.head_spec.feature_layers} but backbone "
                             f"{slot.backbone_id!r} has {depth} layers")
        self.slots[slot.tenant] = slot
        return slot

    def remove_slot(self, tenant: str) -> Slot:
        slot = self.slots.pop(self.slot(tenant).tenant)
        if self.fused is not None:
            self.fused.forget(slot)
        return slot

    def apply_policy(self, snap: PolicySnapshot) -> Slot:
        """Serve `snap`, a tenant's policy version (a new tenant gets a slot). Its weights are copied on
        the lane's copy stream once the producer's copies are complete, and the lane's next work waits
        for them: they land between two groups."""
        slot = self.slots.get(snap.tenant)
        with self.lane.active():
            if slot is None:
                backbone = self._backbone(snap.backbone_id)
                slot = Slot(snap.tenant, snap.head_spec, backbone.meta, device=backbone.device, trainable=False,
                            **self.adapter_targets(snap.backbone_id))
                with self.lane.importing(snap.done):
                    slot.apply_policy(snap)
                return self.add_slot(slot)
            with self.lane.importing(snap.done):
                slot.apply_policy(snap)
        return slot

    def slot(self, tenant: str) -> Slot:
        try:
            return self.slots[tenant]
        except KeyError:
            raise UnknownTenantError(f"no slot for tenant {tenant!r}") from None

    def _backbone(self, backbone_id: str) -> Backbone:
        try:
            return self.backbones[backbone_id]
        except KeyError:
            raise ValueError(f"unknown backbone {backbone_id!r}; this runner has {sorted(self.backbones)}") from None

    # ---- the group size the hardware pays for -------------------------------------------------------
    def calibrate(self, budget_s: float | None = None, force: bool = True, **kw) -> dict[str, GroupCurve]:
        """Measure each backbone's forward time by rows on this runner's device and cap its groups
        where a bigger one stops paying (or passes `budget_s`): `vlamux.model.calibrate`. Call it
        between groups (the engine thread): it runs forwards of its own. force=False: a curve this process
        measured on the same backbone, device, precision and cores is taken as it is."""
        from vlamux.model.calibrate import calibrate

        with self.lane.active():
            for bid, backbone in self.backbones.items():
                self._learned(bid, calibrate(backbone, self.lane, budget_s, reuse=not force, **kw))
        return dict(self.group_curves)

    def calibration(self, budget_s: float | None = None, **kw):
        """`calibrate(force=True)` in steps of one probe forward (a generator; it returns the curves),
        for an engine that serves its queue between the steps. Each step runs on the lane's stream."""
        from vlamux.model.calibrate import calibrate_steps

        for bid, backbone in self.backbones.items():
            steps = calibrate_steps(backbone, self.lane, budget_s, **kw)
            try:
                while True:
                    try:
                        with self.lane.active():
                            next(steps)
                    except StopIteration as done:
                        self._learned(bid, done.value)
                        break
                    yield
            finally:  # closed part-way: the probe it holds is released now, not when collected
                steps.close()
        return dict(self.group_curves)

    def _learned(self, bid: str, curve: GroupCurve) -> None:
        log.info("backbone %s: groups capped at %s rows (%s; measured in %.2fs)", bid, curve.cap, curve.reason,
                 curve.measured_in_s)
        self.group_curves[bid] = curve

    def group_caps(self) -> int | dict | None:
        """The row caps `plan_groups` applies: the configured `max_group_rows`, and each calibrated
        backbone's learned cap (the smaller where both are set)."""
        if not self.group_curves:
            return self.max_group_rows
        return {bid: min(c.cap, self.max_group_rows) if self.max_group_rows else c.cap
                for bid, c in self.group_curves.items()} | {
                    bid: self.max_group_rows for bid in self.backbones if bid not in self.group_curves}

    # ---- execution ------------------------------------------------------------------------------
    def optim_step(self, tenant: str) -> Result:
        t0 = time.perf_counter()
        with self.lane.active():
            try:
                start = self.lane.mark()
                out = self.slot(tenant).optim_step()
                end = self.lane.mark()
                out = self.lane.to_host(out)
                out["grad_norm"] = float(out["grad_norm"])
                return Result(tenant, out, head_s=self.lane.seconds(start, end))
            except Exception as e:  # noqa: BLE001 - one tenant's failure is that tenant's result
                return Result(tenant, error=e, head_s=time.perf_counter() - t0)

    def execute(self, requests: list[Request], grouped: bool = True) -> list[Result]:
        """Run `requests`; results come back in the same order. `grouped=False` runs them one by one."""
        results = [Result(getattr(r, "tenant", "?")) for r in requests]
        with self.lane.active():
            batches = self._ingest(requests, results)
            for indices in self._rounds(requests, sorted(batches)):
                rnd = Round(requests, {i: batches[i].rows for i in indices}, fuse=grouped)
                if grouped:
                    slots = [self.slots[requests[i].tenant] for i in indices]
                    plan = [[indices[j] for j in g] for g in plan_groups(
                        [s.backbone_id for s in slots], [batches[i].batch_size for i in indices], self.group_caps(),
                        [s.tenant for s in slots], [s.tenant if s.adapter is not None else None for s in slots],
                        self.max_adapters_per_group)]
                else:
                    plan = [[i] for i in indices]
                for group in plan:
                    self._run_group(group, batches, results, rnd)
                self._finish(rnd, results)
        return results

    def _ingest(self, requests: list[Request], results: list[Result]) -> dict[int, _Ingested]:
        """Each valid request checked on the host, then copied to the device into the rollout pool:
        its canonical batch (the backbone's input) and its per-row inputs (the head's)."""
        batches: dict[int, _Ingested] = {}
        for i, req in enumerate(requests):
            t0 = time.perf_counter()
            try:
                if not isinstance(req, (ForwardBackward, Sample)):
                    raise InvalidInputError(f"request {i}: expected ForwardBackward or Sample, got {type(req).__name__}")
                slot = self.slot(req.tenant)
                backbone = self.backbones[slot.backbone_id]
                # prepare checks the observation before it copies; a VLM's processor copies nothing (its
                # forward does), and needs no turn at the device's rollout pools
                with self.pools.rollout() if backbone.prepares_on_device else contextlib.nullcontext():
                    batch = backbone.prepare(req.obs, **slot.prepare_kwargs())
                if isinstance(req, ForwardBackward):
                    rows = slot.check_rows(req.obs.batch_size, req.obs.state, req.actions, req.action_mask,
                                           req.loss, train=True)
                else:
                    rows = slot.check_rows(req.obs.batch_size, req.obs.state)
                with self.pools.rollout():
                    batches[i] = _Ingested(batch, rows.to(backbone.device))
            except Exception as e:  # noqa: BLE001
                results[i].error = e
            results[i].backbone_s = time.perf_counter() - t0
        return batches

    @staticmethod
    def _rounds(requests: list[Request], valid: list[int]) -> list[list[int]]:
        """A tenant's second forward_backward of one call goes to a later round: each round settles its
        gradients (and, on failure, rewinds the tenant's generator) before the next one draws."""
        seen: Counter = Counter()
        rounds: list[list[int]] = []
        for i in valid:
            k = seen[requests[i].tenant] if isinstance(requests[i], ForwardBackward) else 0
            if isinstance(requests[i], ForwardBackward):
                seen[requests[i].tenant] += 1
            while len(rounds) <= k:
                rounds.append([])
            rounds[k].append(i)
        return rounds

    def _run_group(self, group: list[int], batches: dict[int, _Ingested], results: list[Result], rnd: Round) -> None:
        """One backbone call for the group's requests; those that train through the backbone (an
        adapter, query tokens) run apart, with gradients, so that nobody else's rows keep activations
        for a backward (their own call is the no-grad one, unchanged by such tenants beside them)."""
        requests = rnd.requests
        training = [i for i in group if isinstance(requests[i], ForwardBackward)
                    and self.slots[requests[i].tenant].trains_backbone]
        plain = [i for i in group if i not in training]
        for sub, grad in ((plain, False), (training, True)):
            if sub:
                self._run_call(sub, batches, results, rnd, grad)

    def _run_call(self, group: list[int], batches: dict[int, _Ingested], results: list[Result], rnd: Round,
                  grad: bool) -> None:
        slots = [self.slots[rnd.requests[i].tenant] for i in group]
        backbone = self.backbones[slots[0].backbone_id]
        n_layers = max(s.head_spec.feature_layers for s in slots)
        start = self.lane.mark()
        try:
            mine = [batches[i].batch for i in group]
            segments = list(zip(backbone.segments(mine), [s.adapter for s in slots])) \
                if any(s.adapter is not None for s in slots) else []
            n_adapters = len({s.tenant for s in slots if s.adapter is not None})
            self.adapter_stats["max_adapters_per_call"] = max(self.adapter_stats["max_adapters_per_call"], n_adapters)
            with adapters.active(segments), torch.set_grad_enabled(grad), self._saved_bytes(grad) as kept:
                # each tenant's own vectors in the shared forward (query tokens; an imported policy's state token)
                queries = [s.backbone_tokens(batches[i].rows) for i, s in zip(group, slots)]
                extra = {"queries": queries} if any(q is not None for q in queries) else {}
                features = backbone.forward_group(mine, n_layers=n_layers, **extra)
            if grad:
                self.adapter_stats["groups"] += 1
                self.adapter_stats["last_activation_bytes"] = kept[0]
                self.adapter_stats["peak_activation_bytes"] = max(self.adapter_stats["peak_activation_bytes"], kept[0])
        except Exception as e:  # noqa: BLE001
            if len(group) > 1:
                # Find the request that broke the group; the others must still succeed.
                log.warning("group of %d requests failed in the backbone (%s); retrying one by one", len(group), e)
                for i in group:
                    self._run_call([i], batches, results, rnd, grad)
                return
            results[group[0]].error = e
            return
        rnd.backbone.append(BackboneCall(group, [batches[i].batch_size for i in group], start, self.lane.mark()))
        for i in group:
            results[i].group_size = len(group)
        mine = {i: f.select(slice(None), None, s.head_spec.feature_layers) for i, s, f in zip(group, slots, features)}
        if grad:
            with self.lane.autocast():
                self.heads.joint(group, mine, rnd)
        else:
            self.heads.run(group, mine, rnd)

    @staticmethod
    @contextlib.contextmanager
    def _saved_bytes(counting: bool):
        """Counts the bytes autograd keeps for the backward of what runs inside (a one-item list)."""
        kept = [0]
        if not counting:
            yield kept
            return
        seen: set = set()

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in seen:  # views of one storage are kept once
                seen.add(key)
                kept[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield kept

    def run_heads(self, requests: list[Request], features: list[VLAFeature], fuse: bool | None = None
                  ) -> list[Result]:
        """The head phase alone, on given features (one per request, as a backbone gave them): what
        `execute` runs after the backbone forward, exposed for the fused-heads benchmark and tests.
        fuse: fuse same-architecture heads (default: the runner's setting)."""
        results = [Result(r.tenant) for r in requests]
        with self.lane.active():
            rnd = Round(requests, fuse=self.fuse_heads if fuse is None else fuse)
            mine = {}
            for i, (r, f) in enumerate(zip(requests, features)):
                slot = self.slot(r.tenant)
                checked = slot.check_rows(r.obs.batch_size, r.obs.state, r.actions, r.action_mask, r.loss, True) \
                    if isinstance(r, ForwardBackward) else slot.check_rows(r.obs.batch_size, r.obs.state)
                rnd.rows[i] = checked.to(slot.device)
                mine[i] = f.select(slice(None), None, slot.head_spec.feature_layers)
            self.heads.run(list(range(len(requests))), mine, rnd)
            self._finish(rnd, results)
        return results

    def _finish(self, rnd: Round, results: list[Result]) -> None:
        """Bring the round's outputs to the host (the one wait), then settle each request."""
        payload = [(w.pending.finite, w.pending.out) if w.pending is not None else w.output for w in rnd.works]
        host = self.lane.to_host(payload)
        for call in rnd.backbone:
            seconds, total = self.lane.seconds(call.start, call.end), sum(call.rows)
            for i, n in zip(call.requests, call.rows):
                results[i].backbone_s += seconds * n / total
        for w, out in zip(rnd.works, host):
            res = results[w.index]
            res.head_s = self.lane.seconds(w.span.start, w.span.end) * w.span.share
            if w.error is not None:
                res.error = w.error
            elif w.pending is not None:
                finite, values = out
                try:
                    res.output = w.slot.settle(w.pending, bool(finite), values)
                except Exception as e:  # noqa: BLE001 - NaN: that tenant's failure only
                    res.error = e
            else:
                res.output = out

