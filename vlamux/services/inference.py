"""The Inference Model Service: a backbone replica and tenant serving slots at a policy version,
serving action requests from its Inference Queue with group batching.

A request's life: `predict` puts it on the queue (a future comes back) -> the engine thread takes
a due group -> applies any staged policy versions (between groups, so a group never mixes versions)
-> one grouped runner call -> each request's future gets {actions, policy_version}.
With a slot budget, a request whose tenant's slot is parked or stored waits in the queue (no group
takes it) while the tiers' mover brings the slot back, as the groups of resident tenants run
(`vlamux.services.slot_tiers`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from vlamux.errors import UnknownTenantError
from vlamux.model import Backbone, ModelRunner, Observation, Sample
from vlamux.model.snapshot import PolicySnapshot
from vlamux.services.accounting import Accounting
from vlamux.services.control import Retired
from vlamux.services.engine import EngineLoop
from vlamux.services.pager import SlotBudget
from vlamux.services.queues import InferenceQueue, InferenceQueueConfig
from vlamux.services.slot_tiers import SlotTiers

log = logging.getLogger(__name__)


@dataclass
class _Predict:
    obs: Observation
    deterministic: bool
    explore: object = None  # a FlowExploration


class InferenceModelService(EngineLoop):
    def __init__(self, backbone: Backbone | list[Backbone], queue: InferenceQueueConfig | None = None,
                 name: str = "inference-0", fuse_heads: bool = True, group_cap: str | None = None,
                 group_budget_s: float | None = None, priority: str = "high", max_adapters_per_group: int | None = None,
                 slot_budget: SlotBudget | None = None):
        """slot_budget: keep at most this many bytes of serving slots resident (the least recently used
        go to host memory, and to disk past its own budget; a request for one waits while it comes
        back; "auto" resident bytes: `SlotBudget.placed`); None: every slot stays resident."""
        self.name = name
        self.group_cap, self.group_budget_s = group_cap, group_budget_s
        # every backbone the replica serves; "high": simulators wait on its answers (model.device)
        self.runner = ModelRunner(backbone, fuse_heads=fuse_heads, priority=priority,
                                  max_adapters_per_group=max_adapters_per_group)
        self.backbone = self.runner.backbones[self.runner.default_backbone]
        slot_budget = slot_budget.placed(self.backbone.device) if slot_budget is not None else None
        self.tiers = SlotTiers(self.runner, slot_budget, name) if slot_budget is not None else None
        self.queue = InferenceQueue(queue, ready=self.tiers.resident if self.tiers is not None else None)
        if self.tiers is not None:
            self.tiers.waiting, self.tiers.on_resident = self.queue.waiting_since, self.queue.wake
            self.tiers.on_refused = self.queue.fail
        self.accounting = Accounting()
        self._staged: dict[str, PolicySnapshot | Retired] = {}
        self._fresh: set[str] = set()  # staged after a retirement: replaces the slot, whatever its version
        self._staged_lock = threading.Lock()

    # ---- control plane ----------------------------------------------------------------------------
    def stage_policy(self, snap: PolicySnapshot | Retired) -> None:
        """Receive a tenant's policy version (or its retirement: its serving slot is freed); it takes
        effect between two groups."""
        if isinstance(snap, Retired):
            with self._staged_lock:
                self._staged[snap.tenant] = snap
            return
        if snap.backbone_id not in self.runner.backbones:
            raise ValueError(f"{self.name}: snapshot for backbone {snap.backbone_id!r}, replica serves "
                             f"{sorted(self.runner.backbones)}")
        with self._staged_lock:
            old = self._staged.get(snap.tenant)
            if isinstance(old, Retired):  # retired, then served again (a finished job's checkpoint)
                self._fresh.add(snap.tenant)
            if old is None or isinstance(old, Retired) or old.version <= snap.version:
                self._staged[snap.tenant] = snap

    def _apply_staged(self) -> None:
        # Under the lock: a tenant is always either staged or served, never momentarily neither.
        # The weights are copied on the lane's copy stream, after the producer's copy is complete,
        # and the next group waits for them: a group runs wholly on one version of each tenant.
        # With tiers, each tenant's under theirs too: its slot does not move while it is looked at.
        with self._staged_lock:
            (staged, self._staged), (fresh, self._fresh) = (self._staged, {}), (self._fresh, set())
            for tenant, snap in staged.items():
                with self.tiers.lock if self.tiers is not None else contextlib.nullcontext():
                    self._apply_one(tenant, snap, tenant in fresh)

    def _apply_one(self, tenant: str, snap: PolicySnapshot | Retired, fresh: bool) -> None:
        if isinstance(snap, Retired) or fresh:  # its slot goes, from whichever tier
            if self.tiers is not None:
                self.tiers.retire(tenant)
            elif tenant in self.runner.slots:
                self.runner.remove_slot(tenant)
        elif self.tiers is not None and self.tiers.knows(tenant) and not self.tiers.resident(tenant):
            self._staged[tenant] = snap  # applied once resident again (its parked RNG goes on)
            return
        if isinstance(snap, Retired):
            if self.tiers is not None:  # its requests would wait for a slot that will not come
                self.queue.fail(tenant, UnknownTenantError(f"{self.name}: tenant {tenant!r} is no longer served"))
            self.queue.forget(tenant)
            return
        slot = self.runner.slots.get(tenant)
        if slot is not None and snap.version < slot.version:
            return
        try:
            if slot is None and self.tiers is not None and not self.tiers.room_for(snap):
                self.tiers.admit_parked(snap)  # resident when asked for, not at the others' cost now
                return
            self.runner.apply_policy(snap)
            if slot is None and self.tiers is not None:
                self.tiers.added(tenant)
        except Exception as e:  # noqa: BLE001 - one tenant's bad snapshot must not cost the others theirs
            log.exception("%s: applying tenant %r version %d failed", self.name, tenant, snap.version)
            if slot is None and self.tiers is not None:  # nothing to serve: what waits for it is answered
                self.queue.fail(tenant, e)

    def policy_version(self, tenant: str) -> int | None:
        """The version the tenant's next group will be served with (a staged one counts)."""
        with self._staged_lock:
            staged = self._staged.get(tenant)
            if isinstance(staged, Retired):
                return None
            slot = self.runner.slots.get(tenant)
            below = self.tiers.version(tenant) if self.tiers is not None else None
            versions = [v for v in (staged and staged.version, slot and slot.version, below) if v is not None]
        return max(versions) if versions else None

    def serves(self, tenant: str) -> bool:
        with self._staged_lock:
            staged = self._staged.get(tenant)
            if staged is not None:
                return not isinstance(staged, Retired)
            return tenant in self.runner.slots or (self.tiers is not None and self.tiers.knows(tenant))

    # ---- data plane -------------------------------------------------------------------------------
    def predict(self, tenant: str, obs: Observation, deterministic: bool = False,
                deadline_s: float | None = None, explore=None) -> Future:
        """An action chunk for each observation: a future of {"actions": [B, H, A], "policy_version"}."""
        if not self.serves(tenant):
            raise UnknownTenantError(f"{self.name} has no policy for tenant {tenant!r}")
        future = self.queue.submit(tenant, obs.batch_size, _Predict(obs, deterministic, explore), deadline_s)
        if self.tiers is not None:
            self.tiers.want(tenant)  # a slot below resident starts coming up while the current group runs
        return future

    def start(self):
        if self.tiers is not None:
            self.tiers.start()
        return super().start()

    def run_once(self, timeout: float | None = 0.1) -> int:
        """Serve one due group (the engine loop's body); returns the number of requests served."""
        group = self.queue.next_group(timeout)
        with self.runner.lane.active():  # this replica's own CUDA stream
            if self.tiers is None:
                self._apply_staged()
                return self._serve(group) if group else 0
            # a group's slots stay resident while it runs; one the mover took down since the queue
            # looked goes back to wait for it (then versions staged for the others apply, before it runs)
            pinned = self.tiers.claim([item.tenant for item in group])
            lost = [item for item in group if item.tenant not in pinned]
            if lost:
                self.queue.requeue(lost)
                group = [item for item in group if item.tenant in pinned]
            try:
                self._apply_staged()
                return self._serve(group) if group else 0
            finally:
                self.tiers.release(pinned)

    def _serve(self, group) -> int:
        t0 = time.perf_counter()
        reqs = [Sample(item.tenant, item.payload.obs, item.payload.deterministic, explore=item.payload.explore)
                for item in group]
        results = self.runner.execute(reqs)
        self.accounting.busy(time.perf_counter() - t0)
        for item, res in zip(group, results):
            self.accounting.charge(item.tenant, backbone_s=res.backbone_s, head_s=res.head_s, requests=1,
                                   rows=item.rows, shared=float(res.group_size > 1))
            if item.future.done():  # cancelled by the caller meanwhile
                continue
            if res.ok:
                out = res.output
                item.future.set_result({"actions": out["actions"], "policy_version": out["policy_version"],
                                        **{k: v for k, v in out.items() if k not in ("actions", "policy_version")}})
            else:
                item.future.set_exception(res.error)
        return len(group)

