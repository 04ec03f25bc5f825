"""The Training Model Service: the backbone and the tenants' slots, executing operations from its
Training Queue.

A request's life: a call (`forward_backward`, `optim_step`, ...) puts an operation on the queue
and returns a future -> the engine thread takes every tenant's ready head operation -> the
forward_backwards of different tenants run as one group, the rest one by one -> futures resolve,
the tenants leave flight -> after an optimizer step the tenant's new policy version goes to the
control plane.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from vlamux.errors import IncompatibleError, InvalidInputError, UnknownTenantError
from vlamux.model import Backbone, ForwardBackward, HeadSpec, ModelRunner, Observation, OptimizerSpec
from vlamux.model.normalize import NormStats
from vlamux.model.policy_loss import PolicyLoss
from vlamux.policy import is_policy_file, policy_snapshot
from vlamux.services.accounting import Accounting
from vlamux.services.engine import EngineLoop
from vlamux.services.control import PolicyPublisher
from vlamux.services.queues import TrainingQueue, TrainOp
from vlamux.services.slot_book import Restore

log = logging.getLogger(__name__)


@dataclass
class _CreateSlot:
    head_spec: HeadSpec
    optim: OptimizerSpec | None
    seed: int
    stats: dict | None
    backbone_id: str | None = None


class TrainingModelService(EngineLoop):
    def __init__(self, backbone: Backbone | list[Backbone], publisher: PolicyPublisher | None = None,
                 max_staleness: int | None = None, max_group_rows: int | None = None, name: str = "training",
                 fuse_heads: bool = True, group_cap: str | None = None, group_budget_s: float | None = None,
                 priority: str = "low", max_adapters_per_group: int | None = None):
        self.name = name
        self.group_cap, self.group_budget_s = group_cap, group_budget_s
        # every backbone this service holds; "low": it yields shared cores or GPU to inference
        self.runner = ModelRunner(backbone, fuse_heads=fuse_heads, priority=priority,
                                  max_adapters_per_group=max_adapters_per_group)
        self.backbone = self.runner.backbones[self.runner.default_backbone]
        self.publisher = publisher
        self.queue = TrainingQueue(self.version, max_staleness, max_group_rows)
        self.accounting = Accounting()

    def start(self):
        # A process's first torch optimizer imports torch._dynamo (about a second on a CPU): made here,
        # before the engine's heartbeat counts, not inside the first tenant's create_slot, where the
        # Health Manager would see a silent engine
        import torch

        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
        return super().start()

    # ---- operations (each returns a future; one tenant's run in submission order) -----------------
    def create_slot(self, tenant: str, head_spec: HeadSpec, optim: OptimizerSpec | None = None, seed: int = 0,
                    stats: dict[str, NormStats] | None = None, backbone_id: str | None = None) -> Future:
        """backbone_id: which of the service's backbones the tenant's head reads (default: the first)."""
        return self.queue.submit(TrainOp(tenant, "create_slot", _CreateSlot(head_spec, optim, seed, stats, backbone_id)))

    def forward_backward(self, tenant: str, obs: Observation, actions: Tensor, action_mask: Tensor | None = None,
                         policy_version: int | None = None, priority: int = 0, loss: PolicyLoss | None = None
                         ) -> Future:
        """policy_version: for RL, the oldest version that produced the batch (the staleness limit
        refuses it with StaleError when too old); loss: the RL objective (None: supervised)."""
        return self.queue.submit(TrainOp(tenant, "forward_backward",
                                         ForwardBackward(tenant, obs, actions, action_mask, loss),
                                         rows=obs.batch_size, priority=priority, policy_version=policy_version))

    def optim_step(self, tenant: str, priority: int = 0) -> Future:
        return self.queue.submit(TrainOp(tenant, "optim_step", priority=priority))

    def save_state(self, tenant: str, path: str | Path) -> Future:
        return self.queue.submit(TrainOp(tenant, "save_state", Path(path)))

    def load_state(self, tenant: str, path: str | Path) -> Future:
        return self.queue.submit(TrainOp(tenant, "load_state", Path(path)))

    def set_lr(self, tenant: str, lr: float, fresh_moments: bool = False) -> Future:
        """Change the tenant's learning rate (e.g. between a job's SFT and RL phases), in order with its
        other operations. fresh_moments: also forget the optimizer's running moments, as a new phase
        with gradients of another scale wants (otherwise they are kept)."""
        if not (isinstance(lr, (int, float)) and lr > 0):
            raise InvalidInputError(f"lr: expected a positive number, got {lr!r}")
        return self.queue.submit(TrainOp(tenant, "set_lr", (float(lr), bool(fresh_moments))))

    def import_adapter(self, tenant: str, path: str | Path) -> Future:
        """Start the tenant's adapter from a PEFT LoRA directory (rank, alpha and Linears must match)."""
        return self.queue.submit(TrainOp(tenant, "import_adapter", Path(path)))

    def export_adapter(self, tenant: str, path: str | Path, base_model: str | None = None) -> Future:
        """Write the tenant's adapter as a PEFT directory."""
        return self.queue.submit(TrainOp(tenant, "export_adapter", (Path(path), base_model)))

    def remove_slot(self, tenant: str) -> Future:
        """Free the tenant's slot (module, optimizer state, statistics), in order after its other
        operations, and have every replica free its serving slot."""
        return self.queue.submit(TrainOp(tenant, "remove_slot"))

    def restore_slot(self, restore: Restore) -> Future:
        """Bring a tenant back after a restart (`vlamux.services.slot_book`): its slot made again (or
        the one there taken), loaded from its checkpoint, else given its newest published weights; in
        order with its other operations. A future of {"policy_version"}."""
        return self.queue.submit(TrainOp(restore.tenant, "restore_slot", restore))

    def export_policy(self, tenant: str) -> Future:
        """The tenant's current policy version (a PolicySnapshot), taken in order with its other
        operations, so never from the middle of an optimizer step."""
        return self.queue.submit(TrainOp(tenant, "export_policy"))

    def version(self, tenant: str) -> int:
        slot = self.runner.slots.get(tenant)
        if slot is None:
            raise UnknownTenantError(f"no slot for tenant {tenant!r}")
        return slot.version

    def tenants(self) -> list[str]:
        return list(self.runner.slots)

    # ---- engine -----------------------------------------------------------------------------------
    def run_once(self, timeout: float | None = 0.1) -> int:
        batch = self.queue.next_batch(timeout)
        if not batch:
            return 0
        with self.runner.lane.active():  # this service's own CUDA stream
            return self._run(batch)

    def _run(self, batch: list[TrainOp]) -> int:
        t0 = time.perf_counter()
        try:
            group = [op for op in batch if op.kind == "forward_backward"]
            if group:
                for op, res in zip(group, self.runner.execute([op.payload for op in group])):
                    self.accounting.charge(op.tenant, backbone_s=res.backbone_s, head_s=res.head_s, rows=op.rows,
                                           shared=float(res.group_size > 1))
                    _resolve(op.future, res.output, res.error)
                # the heartbeat says the engine makes progress, not that a round is short: a round of
                # fifty tenants' steps, optimizer steps and publishes outlasted the Health Manager's
                # 30 s on two cores (Meta-World MT50), and the role was restarted under its jobs
                self.beat()
            for op in batch:
                if op.kind != "forward_backward":
                    t1 = time.perf_counter()
                    try:
                        _resolve(op.future, self._run_op(op), None)
                    except Exception as e:  # noqa: BLE001 - that tenant's failure only
                        _resolve(op.future, None, e)
                    self.accounting.charge(op.tenant, head_s=time.perf_counter() - t1)
                    self.beat()
        finally:
            self.accounting.busy(time.perf_counter() - t0)
            for op in batch:
                self.queue.done(op.tenant)
                if op.kind == "remove_slot":
                    self.queue.forget(op.tenant)
        return len(batch)

    def _run_op(self, op: TrainOp):
        if op.kind == "create_slot":
            c: _CreateSlot = op.payload
            slot = self.runner.create_slot(op.tenant, c.head_spec, c.optim, c.seed, c.backbone_id)
            if c.stats:
                slot.set_stats(**c.stats)
            self._publish(op.tenant)
            return {"policy_version": slot.version}
        if op.kind == "remove_slot":
            self.runner.remove_slot(op.tenant)
            if self.publisher is not None:
                self.publisher.retire(op.tenant)
            return {"removed": op.tenant}
        if op.kind == "optim_step":
            out = self.runner.optim_step(op.tenant).unwrap()
            self._publish(op.tenant)
            return out
        if op.kind == "set_lr":
            slot = self.runner.slot(op.tenant)
            lr, fresh = op.payload
            for g in slot.optimizer.param_groups:
                g["lr"] = lr
            if fresh:
                slot.optimizer.state.clear()  # Adam re-initialises them, bias correction included
            slot.optim_spec = dataclasses.replace(slot.optim_spec, lr=lr)
            return {"lr": lr, "fresh_moments": fresh}
        if op.kind == "import_adapter":
            slot = self.runner.slot(op.tenant)
            published = slot.version
            with self.runner.lane.active():
                slot.import_adapter(op.payload)
            slot.newer_than(published)
            self._publish(op.tenant)
            return {"policy_version": slot.version}
        if op.kind == "restore_slot":
            return self._restore(op.payload)
        if op.kind == "export_adapter":
            path, base = op.payload
            return {"path": str(self.runner.slot(op.tenant).export_adapter(path, base))}
        if op.kind == "export_policy":
            return self.runner.slot(op.tenant).export_policy(self.runner.lane.export)
        if op.kind == "save_state":
            self.runner.slot(op.tenant).save(op.payload)
            return {"path": str(op.payload), "policy_version": self.version(op.tenant)}
        if op.kind == "load_state":
            slot = self.runner.slot(op.tenant)
            published = slot.version  # every version this slot held was published
            if is_policy_file(op.payload):  # a policy (module and statistics), not a whole slot: a fresh optimizer
                self._start_from_policy(slot, op.payload)
            else:
                slot.load_state(op.payload)
            slot.newer_than(published)
            self._publish(op.tenant)
            return {"policy_version": self.version(op.tenant)}
        raise InvalidInputError(f"unknown training operation {op.kind!r}")

    def _restore(self, r: Restore) -> dict:
        slot = self.runner.slots.get(r.tenant) or self.runner.create_slot(
            r.tenant, r.recipe.head_spec, r.recipe.optim, r.recipe.seed, r.recipe.backbone_id)
        if r.checkpoint is not None:
            slot.load_state(r.checkpoint)
            if r.snapshot is not None and r.snapshot.version >= slot.version:
                # versions past the checkpoint were published: training's weights get a new number
                slot.newer_than(r.snapshot.version)
                self._publish(r.tenant)  # the replicas serve what training now holds
        elif r.snapshot is not None:
            self.runner.apply_policy(r.snapshot)
        return {"policy_version": slot.version}

    def _start_from_policy(self, slot, path) -> None:
        snap, _ = policy_snapshot(path, self.runner.backbones[slot.backbone_id], slot.tenant)
        if snap.head_spec != slot.head_spec:
            raise IncompatibleError(f"init_from: the policy file's head {snap.head_spec.to_json()} differs from the "
                                    f"job's {slot.head_spec.to_json()}")
        with self.runner.lane.active():
            slot.apply_policy(snap)
            slot.optimizer.state.clear()

    def _publish(self, tenant: str) -> None:
        if self.publisher is not None:
            # copied to the host on the lane's copy stream: the next step need not wait for it
            with self.runner.lane.active():
                self.publisher.publish(self.runner.slot(tenant).export_policy(self.runner.lane.export))


def _resolve(future: Future, value, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
