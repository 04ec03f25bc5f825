"""A checkpoint as the store recorded it: the view a tenant reads, and the check before anything loads it."""

from __future__ import annotations

from pathlib import Path

from vlamux.errors import CorruptCheckpointError
from vlamux.store import CheckpointRecord
from vlamux.utils.io import file_sha256


def verify(cp: CheckpointRecord) -> None:
    """The checkpoint file still is the one the store recorded (sha256), before anything loads it."""
    path = Path(cp.path)
    if not path.is_file():
        raise CorruptCheckpointError(f"checkpoint {cp.id}: its file is missing")
    if file_sha256(path) != cp.sha256:
        raise CorruptCheckpointError(f"checkpoint {cp.id}: the file does not match the sha256 recorded when "
                                     f"it was saved (altered or damaged since)")


def checkpoint_view(c: CheckpointRecord) -> dict:
    return {"id": c.id, "policy_id": c.policy_id, "policy_version": c.policy_version, "bytes": c.bytes,
            "sha256": c.sha256, "created_at": c.created_at, "job_id": c.job_id}
