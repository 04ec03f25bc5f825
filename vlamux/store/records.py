"""What the store hands out: frozen records (never ORM objects), and the checks its arguments pass."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vlamux.errors import InvalidInputError
from vlamux.store.models import ApiKeyRow, CheckpointRow, JobRow, SlotRow, TenantRow

JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
UNFINISHED = ("queued", "running")
SLOT_STATES = ("creating", "ready", "failed", "deleted")
SLOT_LIVE = ("creating", "ready")  # what a restarted server brings back
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    created_at: float
    disabled: bool
    quotas: dict[str, Any]


@dataclass(frozen=True)
class ApiKey:
    id: str
    tenant_id: str | None
    name: str
    created_at: float
    revoked_at: float | None
    last_used_at: float | None

    @property
    def is_admin(self) -> bool:
        return self.tenant_id is None


@dataclass(frozen=True)
class JobRecord:
    id: str
    tenant_id: str
    name: str
    kind: str
    spec: dict[str, Any]
    state: str
    created_at: float
    updated_at: float
    error: str | None
    result: dict[str, Any] | None
    progress: dict[str, Any] | None
    workdir: str


@dataclass(frozen=True)
class SlotRecord:
    """A training slot: "creating" until the services hold it, then "ready"; "failed" (it says why)
    or "deleted" by its tenant. Its checkpoints outlive it."""
    id: str
    tenant_id: str
    name: str
    spec: dict[str, Any]
    state: str
    created_at: float
    updated_at: float
    error: str | None
    workdir: str


@dataclass(frozen=True)
class JobEvent:
    id: int
    job_id: str
    at: float
    state: str
    detail: str


@dataclass(frozen=True)
class CheckpointRecord:
    id: str
    tenant_id: str
    job_id: str | None
    policy_id: str
    policy_version: int
    path: str
    bytes: int
    sha256: str
    created_at: float


UsageTotals = dict[str, dict[str, float]]  # tenant_id -> kind -> total amount


def to_tenant(r: TenantRow) -> Tenant:
    return Tenant(r.id, r.name, r.created_at, bool(r.disabled), dict(r.quotas or {}))


def to_key(r: ApiKeyRow) -> ApiKey:
    return ApiKey(r.id, r.tenant_id, r.name, r.created_at, r.revoked_at, r.last_used_at)


def to_job(r: JobRow) -> JobRecord:
    return JobRecord(r.id, r.tenant_id, r.name, r.kind, r.spec, r.state, r.created_at, r.updated_at,
                     r.error, r.result, r.progress, r.workdir)


def to_slot(r: SlotRow) -> SlotRecord:
    return SlotRecord(r.id, r.tenant_id, r.name, r.spec, r.state, r.created_at, r.updated_at, r.error, r.workdir)


def to_checkpoint(r: CheckpointRow) -> CheckpointRecord:
    return CheckpointRecord(r.id, r.tenant_id, r.job_id, r.policy_id, r.policy_version, r.path,
                            r.bytes, r.sha256, r.created_at)


def secret_digest(secret: str) -> str:
    """How a key's secret is stored and looked up (and cached): its sha256, never the secret."""
    return hashlib.sha256(secret.encode()).hexdigest()



def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidInputError(f"name must be 1-64 characters of [A-Za-z0-9_.-], got {name!r}")
    return name


def check_json(value: Any, arg: str) -> dict[str, Any]:
    # Reject here, with the argument's name, rather than as an opaque flush error;
    # NaN is refused because PostgreSQL's JSON cannot hold it.
    if not isinstance(value, dict):
        raise InvalidInputError(f"{arg} must be a dict, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"{arg} must be JSON-serialisable without NaN/inf: {e}") from None


def check_states(states: Iterable[str] | None, allowed: tuple[str, ...] = JOB_STATES) -> tuple[str, ...] | None:
    if states is None:
        return None
    states = (states,) if isinstance(states, str) else tuple(states)
    bad = [s for s in states if s not in allowed]
    if bad:
        raise InvalidInputError(f"states must be among {allowed}, got {bad!r}")
    return states


def check_str(value: Any, arg: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise InvalidInputError(f"{arg} must be a {'' if allow_empty else 'non-empty '}string, got {value!r}")
    return value


def existing(session, table, row_id: str, what: str):
    """The row, or KeyError("no <what> '<id>'") for a change aimed at a row that is not there."""
    row = session.get(table, row_id)
    if row is None:
        raise KeyError(f"no {what} {row_id!r}")
    return row
