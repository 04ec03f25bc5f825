"""A tenant's policies: every job's and every training slot's, as one list. Each can be viewed, asked
for actions and downloaded as a policy file (vlamux's, or LeRobot's for an imported one)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from vlamux.api.checkpoints import checkpoint_view, verify
from vlamux.api.faults import Conflict, NotFound
from vlamux.api.served import ServedPolicies
from vlamux.api.slots import slot_key, usable
from vlamux.errors import InvalidInputError, UnknownTenantError, public_message
from vlamux.store import JobRecord, SlotRecord, Store

if TYPE_CHECKING:
    from vlamux.services.contract import Runtime


class Policies:
    def __init__(self, store: Store, runtime: Runtime, served: ServedPolicies, data_dir: Path):
        self.store, self.runtime, self.served, self.data_dir = store, runtime, served, data_dir

    def _find(self, tenant_id: str, policy_id: str) -> JobRecord | SlotRecord:
        rec = self.store.get_slot(policy_id, tenant_id) or self.store.get_job(policy_id, tenant_id)
        if rec is None:
            raise NotFound(f"no policy {policy_id!r}")
        return rec

    def _checkpoints(self, rec: JobRecord | SlotRecord):
        """The policy's checkpoints, newest first: a slot's by its id, a job's by the job."""
        if isinstance(rec, SlotRecord):
            return self.store.list_checkpoints(rec.tenant_id, policy_id=rec.id)
        return self.store.list_checkpoints(rec.tenant_id, job_id=rec.id)

    def view(self, tenant_id: str, policy_id: str) -> dict:
        return self._view(self._find(tenant_id, policy_id))

    def _view(self, rec: JobRecord | SlotRecord) -> dict:
        slot = isinstance(rec, SlotRecord)
        try:
            version = self.runtime.version(slot_key(rec.tenant_id, rec.id))  # a live slot's
        except UnknownTenantError:
            version = None
        if version is None and not slot:  # an ended job's policy: its newest checkpoint's
            cps = self._checkpoints(rec)
            version = cps[0].policy_version if cps else None
        head = rec.spec.get("head") if isinstance(rec.spec, dict) else None
        view = {"id": rec.id, "source": "training_slot" if slot else "job", "name": rec.name,
                "head": head, "policy_version": version, "created_at": rec.created_at}
        if slot and rec.state == "failed":
            view.update(state="failed", error=public_message(rec.error or ""), policy_version=None)
        elif slot and rec.state == "deleted":
            view.update(state="deleted", policy_version=None)
        return view

    def list(self, tenant_id: str) -> list[dict]:
        """Newest first. A slot whose creation was refused never existed; one that had saved state
        and failed or was deleted stays listed (its checkpoints can still be downloaded)."""
        slots = [r for r in self.store.list_slots(tenant_id)
                 if r.state in ("creating", "ready") or self._checkpoints(r)]
        recs = sorted([*self.store.list_jobs(tenant_id), *slots], key=lambda r: (r.created_at, r.id), reverse=True)
        return [self._view(r) for r in recs]

    def versions(self, tenant_id: str, policy_id: str) -> dict:
        view = self.view(tenant_id, policy_id)
        cps = self.store.list_checkpoints(tenant_id, policy_id=policy_id)
        return {"live": view["policy_version"], "checkpoints": [checkpoint_view(c) for c in cps]}

    def predict(self, tenant_id: str, policy_id: str, obs, deterministic: bool):
        rec = self._find(tenant_id, policy_id)
        key = slot_key(tenant_id, policy_id)
        if isinstance(rec, SlotRecord):
            usable(rec)
        elif rec.state not in ("queued", "running"):  # its slot is gone: its newest checkpoint is served
            self.served.ensure(key, tenant_id, self._checkpoints(rec), verify)
        return self.runtime.predict(key, obs, deterministic)

    def file(self, tenant_id: str, policy_id: str, version: int | None = None, fmt: str = "vlamux"
             ) -> tuple[Path, int]:
        """A policy file (vlamux.policy) of the tenant's policy: version `version` (a checkpoint's),
        or the live one; fmt "lerobot": a tar of the LeRobot checkpoint directory an imported policy
        leaves as (vlamux.model.vla.export). Written under the tenant's directory; the caller deletes
        it once sent."""
        if fmt not in ("vlamux", "lerobot"):
            raise InvalidInputError(f"format: 'vlamux' or 'lerobot', got {str(fmt)[:40]!r}")
        from vlamux.policy import snapshot_of, write_policy

        rec = self._find(tenant_id, policy_id)
        if isinstance(rec, SlotRecord) and version is None:  # a deleted or failed slot's checkpoints stay downloadable
            usable(rec)
        key = slot_key(tenant_id, policy_id)
        out_dir = self.data_dir / "tenants" / tenant_id / "downloads"
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f"{uuid.uuid4().hex}.slot.safetensors"
        try:
            if version is None and key in self.runtime.tenants():
                self.runtime.save_state(key, tmp).result(120)  # the live version, as the trainer holds it
                source = tmp
            else:
                every = self._checkpoints(rec)
                cps = [c for c in every if version is None or c.policy_version == version]
                if not cps:
                    have = sorted({c.policy_version for c in every})
                    raise NotFound(f"policy {policy_id!r} has no checkpoint of version {version}; versions: {have}")
                verify(cps[0])
                source = Path(cps[0].path)
            snap = snapshot_of(source)
        finally:
            tmp.unlink(missing_ok=True)
        held = next((b for b in self.runtime.describe_backbones() if b["id"] == snap.backbone_id), {})
        if held.get("sha256") is None:
            raise Conflict(f"policy {policy_id!r} was trained on backbone {snap.backbone_id!r}, which this service "
                           f"no longer holds: its content hash is unknown")
        if fmt == "lerobot":
            return _lerobot_tar(snap, held, out_dir), snap.version
        path = write_policy(snap, held["sha256"], out_dir / f"{uuid.uuid4().hex}.policy.safetensors")
        return path, snap.version


def _lerobot_tar(snap, backbone: dict, out_dir: Path) -> Path:
    """An imported policy's snapshot as a tar of the LeRobot checkpoint directory it leaves as."""
    import tarfile

    from vlamux.model.vla.export import write_lerobot

    if backbone.get("kind") != "lerobot":
        raise InvalidInputError(f"format: 'lerobot' is for policies imported from a LeRobot checkpoint; this one's "
                                f"head is of kind {snap.head_spec.kind!r} on backbone {snap.backbone_id!r}")
    work = out_dir / f".lerobot-{uuid.uuid4().hex}"
    path = out_dir / f"{uuid.uuid4().hex}.lerobot.tar"
    try:
        write_lerobot(work / "policy", backbone["checkpoint"], backbone["sha256"], snap.head_spec,
                      snap.ready().tensors, snap.stats_modes)
        with tarfile.open(path, "w") as tar:
            tar.add(work / "policy", arcname="policy")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path
