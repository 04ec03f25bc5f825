"""Training slots: a tenant's policy driven step by step over the API (forward_backward, optim_step,
save_state, load_state), Tinker-style. Each has its own store record (vlamux.store SlotRecord), never a
job's; its saved states are checkpoints named by the slot's id, and they outlive it."""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from vlamux.api.checkpoints import checkpoint_view, verify
from vlamux.api.faults import Conflict, NotFound
from vlamux.api.futures import Futures
from vlamux.api.quotas import Need
from vlamux.errors import InvalidInputError, UnknownTenantError, public_error
from vlamux.model import HeadSpec, OptimizerSpec
from vlamux.model.slot_file import read_slot_file
from vlamux.specs import build
from vlamux.store import SlotRecord, Store
from vlamux.utils.io import file_sha256

if TYPE_CHECKING:
    from vlamux.services.contract import Runtime

log = logging.getLogger(__name__)

SLOT_FIELDS = ("head", "optimizer", "seed", "name", "backbone")


def slot_key(tenant_id: str, policy_id: str) -> str:
    """The services' name for a tenant's policy: a tenant may run several jobs and slots at once."""
    return f"{tenant_id}/{policy_id}"


def usable(rec: SlotRecord) -> None:
    if rec.state == "failed":
        raise Conflict(f"training slot {rec.id!r} failed and serves nothing: {rec.error}")
    if rec.state == "deleted":
        raise NotFound(f"training slot {rec.id!r} was deleted")


class TrainingSlots:
    """`reserve(tenant, holder, need, retry_after_s, force)` holds a slot's place in the tenant's
    max_training_slots (the ledger's), `release(tenant, holder)` gives it back."""

    def __init__(self, store: Store, runtime: Runtime, futures: Futures, data_dir: Path,
                 reserve: Callable[..., None], release: Callable[[str, str], None]):
        self.store, self.runtime, self.futures = store, runtime, futures
        self.data_dir = data_dir
        self._reserve, self._release = reserve, release

    def create(self, tenant_id: str, body: dict) -> SlotRecord:
        if not isinstance(body, dict):
            raise InvalidInputError("body: expected a JSON object")
        unknown = set(body) - set(SLOT_FIELDS)
        if unknown:
            raise InvalidInputError(f"{sorted(unknown)[0]}: unknown field; allowed: {', '.join(SLOT_FIELDS)}")
        backbone = body.get("backbone")
        if backbone is not None and backbone not in self.runtime.backbone_names():
            raise InvalidInputError(f"backbone: this service holds {self.runtime.backbone_names()}, not {backbone!r}")
        if "head" not in body:
            raise InvalidInputError("head: required")
        head = build(HeadSpec, body["head"], "head")
        optim = build(OptimizerSpec, body.get("optimizer") or {}, "optimizer")
        seed = body.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise InvalidInputError(f"seed: expected an integer, got {seed!r}")
        policy_id = uuid.uuid4().hex[:12]
        workdir = self.data_dir / "tenants" / tenant_id / "slots" / policy_id
        spec = {"head": asdict(head), "optimizer": asdict(optim), "seed": seed, "backbone": backbone}
        self._reserve(tenant_id, f"slot:{policy_id}", Need(slots=1), retry_after_s=60.0)
        try:
            rec = self.store.create_slot(tenant_id, policy_id, body.get("name") or f"slot-{policy_id}", spec,
                                         str(workdir))
        except BaseException:
            self._release(tenant_id, f"slot:{policy_id}")
            raise
        try:
            self.runtime.create_slot(slot_key(tenant_id, policy_id), head, optim, seed, backbone=backbone).result(60)
        except Exception as e:
            self._release(tenant_id, f"slot:{policy_id}")
            self.store.set_slot_state(rec.id, "failed", error=f"{type(e).__name__}: {e}")
            raise
        rec = self.store.set_slot_state(rec.id, "ready")
        self.runtime.flush(30)  # the replicas serve the new policy before its id is handed out
        return rec

    def delete(self, tenant_id: str, policy_id: str) -> None:
        """Free a training slot for good (training and every replica) and its place in the tenant's
        max_training_slots; its saved checkpoints stay downloadable. A restart does not bring it back."""
        rec = self.store.get_slot(policy_id, tenant_id)
        if rec is None or rec.state == "deleted":
            raise NotFound(f"no training slot {policy_id!r}")
        if rec.state != "failed":  # a failed slot has nothing in the services
            try:
                self.runtime.remove_slot(slot_key(tenant_id, policy_id)).result(120)
            except UnknownTenantError:
                log.info("training slot %s had no slot in the services", policy_id)
        self.store.set_slot_state(rec.id, "deleted")
        self._release(tenant_id, f"slot:{policy_id}")

    def restore_all(self) -> None:
        """Training slots come back at their last saved state (what `save_state` promised), or, when
        that state cannot be read back, as failed slots that say why: never at version 0 as if new."""
        for rec in self.store.live_slots():
            key = slot_key(rec.tenant_id, rec.id)
            self._reserve(rec.tenant_id, f"slot:{rec.id}", Need(slots=1), 0.0, force=True)  # failed or not: it exists
            try:
                head = build(HeadSpec, rec.spec["head"], "head")
                optim = build(OptimizerSpec, rec.spec["optimizer"], "optimizer")
                cps = self.store.list_checkpoints(rec.tenant_id, policy_id=rec.id)
                if cps:
                    verify(cps[0])
                    read_slot_file(cps[0].path)  # readable, its digest and finite: checked before a slot exists
                self.runtime.create_slot(key, head, optim, rec.spec.get("seed", 0),
                                         backbone=rec.spec.get("backbone")).result(60)
                if cps:
                    self.runtime.load_state(key, cps[0].path).result(60)
                if rec.state == "creating":
                    self.store.set_slot_state(rec.id, "ready")
            except Exception as e:  # noqa: BLE001 - one slot's damage must not keep the service down
                log.exception("cannot restore training slot %s", rec.id)
                self.store.set_slot_state(rec.id, "failed", error=f"restore failed at start-up: {public_error(e)}")

    def _key(self, tenant_id: str, policy_id: str) -> tuple[str, SlotRecord]:
        """The services' key of a slot the tenant may drive, with its record."""
        rec = self.store.get_slot(policy_id, tenant_id)
        if rec is None:
            if self.store.get_job(policy_id, tenant_id) is not None:
                raise NotFound(f"no training slot {policy_id!r} (a job's policy is trained by its job)")
            raise NotFound(f"no policy {policy_id!r}")
        usable(rec)
        return slot_key(tenant_id, policy_id), rec

    def forward_backward(self, tenant_id: str, policy_id: str, obs, actions, action_mask) -> dict:
        key, _ = self._key(tenant_id, policy_id)
        return self.futures.track(tenant_id, "forward_backward",
                                  self.runtime.forward_backward(key, obs, actions, action_mask))

    def optim_step(self, tenant_id: str, policy_id: str, lr: float | None = None) -> dict:
        key, _ = self._key(tenant_id, policy_id)
        if lr is not None:
            self.runtime.set_lr(key, lr)  # queued ahead of the step, in order
        return self.futures.track(tenant_id, "optim_step", self.runtime.optim_step(key))

    def save_state(self, tenant_id: str, policy_id: str) -> dict:
        key, rec = self._key(tenant_id, policy_id)
        path = Path(rec.workdir) / f"{uuid.uuid4().hex[:12]}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        out: Future = Future()

        def saved(f: Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
            # Calls of a slot run in order, so at completion the slot still holds the saved version.
            version = self.runtime.version(key)
            cp = self.store.add_checkpoint(tenant_id, policy_id, version, str(path), path.stat().st_size,
                                           file_sha256(path))
            out.set_result({"checkpoint": checkpoint_view(cp)})

        self.runtime.save_state(key, path).add_done_callback(saved)
        return self.futures.track(tenant_id, "save_state", out)

    def load_state(self, tenant_id: str, policy_id: str, checkpoint_id) -> dict:
        key, _ = self._key(tenant_id, policy_id)
        cp = self.store.get_checkpoint(checkpoint_id, tenant_id) if isinstance(checkpoint_id, str) else None
        if cp is None or cp.policy_id != policy_id:
            raise NotFound(f"no checkpoint {checkpoint_id!r} of policy {policy_id!r}")
        verify(cp)
        return self.futures.track(tenant_id, "load_state", self.runtime.load_state(key, cp.path))
