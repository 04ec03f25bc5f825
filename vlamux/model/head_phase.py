"""A round's head phase: each request's head on its rows of the group's features.

Requests whose heads share an architecture and call mode run as one fused call (`vlamux.model.fused`),
the others one by one in their own slots; those that train through the backbone (`joint`) take one
backward through their heads and the shared backbone call together. Nothing here waits for the device:
each request's work is queued in the round (`Round`) with the span of lane marks it ran in, and the
model runner brings the round's results to the host at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlamux.model.device import Lane
from vlamux.model.feature import VLAFeature
from vlamux.model.fused import FusedHeads, architecture
from vlamux.model.group import ForwardBackward, Request, Sample, given_draws
from vlamux.model.slot import Slot
from vlamux.model.slot_inputs import PendingGrads, RowInputs

log = logging.getLogger(__name__)


@dataclass
class Span:
    """Where a piece of work ran on the lane (two marks) and this request's share of it."""

    start: object
    end: object
    share: float = 1.0

    @classmethod
    def failed(cls, at) -> "Span":
        return cls(at, at, 0.0)


@dataclass
class Work:
    """Head work queued for one request, waiting for the round's host transfer."""

    index: int
    slot: Slot
    pending: PendingGrads | None = None  # forward_backward
    output: dict | None = None  # sample (device tensors)
    span: Span | None = None
    error: Exception | None = None


@dataclass
class BackboneCall:
    """One backbone call of a round: its requests, their rows, and its span."""

    requests: list[int]
    rows: list[int]
    start: object
    end: object


@dataclass
class Round:
    """One execute call's round: its requests with their checked row inputs (by request index), whether
    heads of one architecture fuse, and what it did (head work, backbone calls) for the one host transfer."""

    requests: list[Request] = field(default_factory=list)
    rows: dict[int, RowInputs] = field(default_factory=dict)
    fuse: bool = True
    works: list[Work] = field(default_factory=list)
    backbone: list[BackboneCall] = field(default_factory=list)


@dataclass
class _Gathered:
    """A bucket's requests whose inputs were good, in order, with what their fused call needs."""

    works: list[Work] = field(default_factory=list)
    inputs: list = field(default_factory=list)  # FBInputs, or sample inputs (feature, state)
    rows: list[int] = field(default_factory=list)
    noises: list[dict] = field(default_factory=list)
    rngs: list = field(default_factory=list)  # each slot's generator state before its draws

    def rewind(self) -> None:
        """Every slot's generator back to before the bucket drew (a tenant twice: to its first state)."""
        for w, rng in reversed(list(zip(self.works, self.rngs))):
            w.slot.generator.set_state(rng)


@dataclass
class _Objective:
    """A joint request's loss, awaiting the one backward, with its slot's generator state before its draws."""

    work: Work
    loss: Tensor
    metrics: dict
    extra: dict
    rng: Tensor


class HeadPhase:
    """Runs the heads of a round's groups on a runner's slots, fused heads and lane."""

    def __init__(self, slots: dict[str, Slot], fused: FusedHeads | None, lane: Lane):
        self.slots, self.fused, self.lane = slots, fused, lane

    def run(self, group: list[int], features: dict[int, VLAFeature], rnd: Round) -> None:
        """The heads of a no-grad backbone call: fused buckets, then the rest one by one."""
        with self.lane.autocast():
            for bucket in self.buckets(group, rnd):
                if len(bucket) > 1:
                    self._fused(bucket, features, rnd)
                else:
                    self._single(bucket[0], features[bucket[0]], rnd)

    def buckets(self, group: list[int], rnd: Round, joint: bool = False) -> list[list[int]]:
        """The group's requests by head architecture and call mode, in order; unfused: one each.
        joint: the requests train through the backbone (their features carry its graph)."""
        requests = rnd.requests
        if not rnd.fuse or self.fused is None:
            return [[i] for i in group]
        buckets: dict[tuple, list[int]] = {}
        for i in group:
            slot = self.slots[requests[i].tenant]
            # a head that does not stack (an imported expert), or a request with its own draws, runs alone
            alone = not getattr(slot.head, "FUSABLE", True) or getattr(requests[i], "noise", None) is not None
            key = ("alone", i) if alone else architecture(slot, _mode(requests[i]))
            buckets.setdefault(key, []).append(i)
        out = []
        for bucket in buckets.values():
            # a head fused by mapping (torch.func.vmap) pays a per-operation cost that two tenants' own
            # calls do not on a CPU; it says from how many tenants on a device fusing pays
            slot = self.slots[requests[bucket[0]].tenant]
            least = getattr(slot.head, "FUSE_FROM", {}).get(slot.device.type, 2)
            # and one fused through the backbone copies each tenant's prefix into the stack and its gradient
            # back: a head says up to what size of its own that pays on a device
            most = getattr(slot.head, "JOINT_FUSE_MAX_PARAMS", {}).get(slot.device.type) if joint else None
            fits = most is None or sum(p.numel() for p in slot.params) <= most
            out += [bucket] if len(bucket) >= least and fits else [[i] for i in bucket]
        return out

    # ---- heads on no-grad features ------------------------------------------------------------------
    def _single(self, i: int, feature: VLAFeature, rnd: Round) -> None:
        req, rows = rnd.requests[i], rnd.rows[i]
        slot = self.slots[req.tenant]
        work = Work(i, slot)
        start = self.lane.mark()
        try:
            if isinstance(req, ForwardBackward):
                work.pending = slot.compute(slot.fb_inputs(feature, rows), noise=given_draws(req))
            else:
                work.output = slot.sample_rows(feature, rows, req.deterministic, noise=given_draws(req),
                                               explore=req.explore)
        except Exception as e:  # noqa: BLE001 - one tenant's failure is that tenant's result
            log.debug("tenant %r request failed: %s", slot.tenant, e)
            work.error = e
        work.span = Span(start, self.lane.mark())
        rnd.works.append(work)

    def _gather(self, bucket: list[int], features: dict[int, VLAFeature], rnd: Round, start, training: bool
                ) -> _Gathered:
        """Each request's inputs and draws for a fused call; a request whose inputs are bad fails alone."""
        got = _Gathered()
        for i in bucket:
            req = rnd.requests[i]
            slot = self.slots[req.tenant]
            try:
                if training:
                    x = slot.fb_inputs(features[i], rnd.rows[i])
                    rows = x.feature.batch_size
                else:
                    x = slot.sample_inputs(features[i], rnd.rows[i])
                    rows = x[0].batch_size
            except Exception as e:  # noqa: BLE001
                rnd.works.append(Work(i, slot, error=e, span=Span.failed(start)))
                continue
            got.rngs.append(slot.generator.get_state())
            got.noises.append({} if training and x.loss is not None else
                              slot.draw("loss" if training else "sample", rows, getattr(req, "deterministic", False),
                                        getattr(req, "explore", None)))
            got.works.append(Work(i, slot))
            got.inputs.append(x)
            got.rows.append(rows)
        return got

    def _fused(self, bucket: list[int], features: dict[int, VLAFeature], rnd: Round) -> None:
        """One call for the bucket's heads; if the fused call itself fails, every request of the bucket
        runs on its own instead."""
        start = self.lane.mark()
        first = rnd.requests[bucket[0]]
        training = isinstance(first, ForwardBackward)
        got = self._gather(bucket, features, rnd, start, training)
        if not got.works:
            return
        slots = [w.slot for w in got.works]
        try:
            if training:
                for w, p in zip(got.works, self.fused.forward_backward(slots, got.inputs, got.noises, got.rngs)):
                    w.pending = p
            else:
                outs = self.fused.sample(slots, [x[0] for x in got.inputs], [x[1] for x in got.inputs], got.noises,
                                         first.deterministic)
                for w, out in zip(got.works, outs):
                    w.output = w.slot.finish_sample(out)
        except Exception as e:  # noqa: BLE001 - fall back to the per-tenant path
            log.warning("fused heads of %d requests failed (%s); running them one by one", len(got.works), e)
            got.rewind()
            for w in got.works:
                self._single(w.index, features[w.index], rnd)
            return
        end, total = self.lane.mark(), sum(got.rows)
        for w, rows in zip(got.works, got.rows):
            w.span = Span(start, end, rows / total)
            rnd.works.append(w)

    # ---- heads that train through the backbone --------------------------------------------------------
    def joint(self, group: list[int], features: dict[int, VLAFeature], rnd: Round) -> None:
        """Forward_backwards that train through the backbone (adapters, query tokens, an imported
        expert's state token): every loss first, heads of one architecture as one stacked call, then one
        backward through the heads and the shared backbone call to every head and adapter (each tenant's
        rows are its own in every layer, so each gradient is its own tenant's, and one NaN stays in its
        tenant)."""
        start = self.lane.mark()
        objectives: list[_Objective] = []
        stacks: list[tuple] = []  # (StackedHeads, [(index into objectives, index in the stack)])
        for bucket in self.buckets(group, rnd, joint=True):
            alone = self._joint_fused(bucket, features, rnd, start, objectives, stacks) if len(bucket) > 1 else bucket
            for i in alone:
                self._joint_single(i, features[i], rnd, start, objectives)
        if not objectives:
            return
        own = [p for o in objectives for p in o.work.slot.params]
        stacked = [p for heads, _ in stacks for p in heads.params]
        try:
            grads = torch.autograd.grad(torch.stack([o.loss for o in objectives]).sum(), own + stacked,
                                        allow_unused=True)
        except Exception as e:  # noqa: BLE001
            for o in reversed(objectives):  # a tenant twice: back to its first state
                o.work.slot.generator.set_state(o.rng)
            for o in objectives:
                o.work.error, o.work.span = e, Span.failed(start)
                rnd.works.append(o.work)
            return
        mine, at = [], 0
        for o in objectives:
            mine.append(list(grads[at:at + len(o.work.slot.params)]))
            at += len(o.work.slot.params)
        for heads, members in stacks:  # each tenant's slice of its stack's gradients, added to its own
            # dense slices for the tenants' optimizers, as FusedHeads.forward_backward makes them
            part = [None if g is None else g.contiguous() for g in grads[at:at + len(heads.params)]]
            at += len(heads.params)
            for k, row in members:
                for j, pos in enumerate(heads.positions(objectives[k].work.slot)):
                    if pos is not None and part[pos] is not None:
                        mine[k][j] = part[pos][row] if mine[k][j] is None else mine[k][j] + part[pos][row]
        end = self.lane.mark()
        total = sum(features[o.work.index].batch_size for o in objectives)
        for o, g in zip(objectives, mine):
            w = o.work
            w.pending = Slot.pending(o.loss, o.metrics, o.extra, g, o.rng)
            w.span = Span(start, end, features[w.index].batch_size / total)  # the shared backward, by rows
            rnd.works.append(w)

    def _joint_single(self, i: int, feature: VLAFeature, rnd: Round, start, objectives: list[_Objective]) -> None:
        req = rnd.requests[i]
        slot = self.slots[req.tenant]
        try:
            x = slot.fb_inputs(feature, rnd.rows[i])
            rng = slot.generator.get_state()
            given = given_draws(req)
            noise = given if given is not None else slot.draw("loss", x.feature.batch_size) if x.loss is None else {}
            loss, metrics, extra = slot.objective(x, slot.head_forward(x, noise))
        except Exception as e:  # noqa: BLE001 - that tenant's failure only
            rnd.works.append(Work(i, slot, error=e, span=Span.failed(start)))
            return
        objectives.append(_Objective(Work(i, slot), loss, metrics, extra, rng))

    def _joint_fused(self, bucket: list[int], features: dict[int, VLAFeature], rnd: Round, start,
                     objectives: list[_Objective], stacks: list) -> list[int]:
        """The bucket's losses from one stacked call (`FusedHeads.objectives`), differentiable to the
        stacked parameters and through each tenant's features; returns the requests to run one by one
        instead (all of them, if the stacked call fails)."""
        got = self._gather(bucket, features, rnd, start, training=True)
        if not got.works:
            return []
        try:
            heads, per = self.fused.objectives([w.slot for w in got.works], got.inputs, got.noises)
        except Exception as e:  # noqa: BLE001 - fall back to the per-tenant path
            log.warning("fused heads of %d requests failed (%s); running them one by one", len(got.works), e)
            got.rewind()
            return [w.index for w in got.works]
        stacks.append((heads, [(len(objectives) + k, k) for k in range(len(got.works))]))
        for w, rng, (loss, metrics, extra) in zip(got.works, got.rngs, per):
            objectives.append(_Objective(w, loss, metrics, extra, rng))
        return []


def _mode(req: Request) -> str:
    """A request's call mode, part of what fusing needs to match."""
    if isinstance(req, Sample):
        if req.deterministic:
            return "sample-deterministic"
        # exploring requests draw a chain's noise, and stack only with those of as many stochastic steps
        return "sample" if req.explore is None else f"sample-explore-{req.explore.steps_trained}"
    if req.loss is None:
        return "supervised"
    mode = "rl-value" if req.loss.returns is not None else "rl"
    if req.loss.sampled is not None:  # a chain's stochastic steps: as many in every request stacked
        mode += f"-chain-{tuple(req.loss.sampled['chain_steps'].shape[1:])}"
    return mode
