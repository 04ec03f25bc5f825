"""Persistent store of the tenant-facing service: tenants, API keys, jobs, checkpoints, usage.

One short session per call, so any number of server threads can share a
`Store`. Every method returns frozen dataclasses, never ORM objects.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from vlamux.errors import InvalidInputError
from vlamux.store.models import ApiKeyRow, Base, CheckpointRow, JobEventRow, JobRow, TenantRow, UsageRow

log = logging.getLogger(__name__)

JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
UNFINISHED = ("queued", "running")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LAST_USED_EVERY_S = 60.0  # authenticate writes last_used_at at most this often per key


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


def _tenant(r: TenantRow) -> Tenant:
    return Tenant(r.id, r.name, r.created_at, bool(r.disabled), dict(r.quotas or {}))


def _key(r: ApiKeyRow) -> ApiKey:
    return ApiKey(r.id, r.tenant_id, r.name, r.created_at, r.revoked_at, r.last_used_at)


def _job(r: JobRow) -> JobRecord:
    return JobRecord(r.id, r.tenant_id, r.name, r.kind, r.spec, r.state, r.created_at, r.updated_at,
                     r.error, r.result, r.progress, r.workdir)


def _checkpoint(r: CheckpointRow) -> CheckpointRecord:
    return CheckpointRecord(r.id, r.tenant_id, r.job_id, r.policy_id, r.policy_version, r.path,
                            r.bytes, r.sha256, r.created_at)


def secret_digest(secret: str) -> str:
    """How a key's secret is stored and looked up (and cached): its sha256, never the secret."""
    return hashlib.sha256(secret.encode()).hexdigest()



def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidInputError(f"name must be 1-64 characters of [A-Za-z0-9_.-], got {name!r}")
    return name


def _check_json(value: Any, arg: str) -> dict[str, Any]:
    # Reject here, with the argument's name, rather than as an opaque flush error;
    # NaN is refused because PostgreSQL's JSON cannot hold it.
    if not isinstance(value, dict):
        raise InvalidInputError(f"{arg} must be a dict, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"{arg} must be JSON-serialisable without NaN/inf: {e}") from None


def _check_states(states: Iterable[str] | None) -> tuple[str, ...] | None:
    if states is None:
        return None
    states = (states,) if isinstance(states, str) else tuple(states)
    bad = [s for s in states if s not in JOB_STATES]
    if bad:
        raise InvalidInputError(f"states must be among {JOB_STATES}, got {bad!r}")
    return states


def _check_str(value: Any, arg: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise InvalidInputError(f"{arg} must be a {'' if allow_empty else 'non-empty '}string, got {value!r}")
    return value


def _existing(session, table, row_id: str, what: str):
    """The row, or KeyError("no <what> '<id>'") for a change aimed at a row that is not there."""
    row = session.get(table, row_id)
    if row is None:
        raise KeyError(f"no {what} {row_id!r}")
    return row


class Store:
    """The service's database. Default: SQLite at `<data_dir>/vlamux.db`; any SQLAlchemy URL works."""

    def __init__(self, url: str | None = None, data_dir: str | Path = "data/service"):
        if url is None:
            Path(data_dir).mkdir(parents=True, exist_ok=True)
            db = Path(data_dir) / "vlamux.db"
            # key digests, quotas and every tenant's jobs: only the service's user reads the file
            os.close(os.open(db, os.O_WRONLY | os.O_CREAT, 0o600))
            db.chmod(0o600)
            url = f"sqlite:///{db}"
        self.url = url
        if url.startswith("sqlite"):
            # Many server threads share the pool; the busy timeout makes writers queue, not fail.
            engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
            _tune_sqlite(engine)
        else:
            engine = create_engine(url, pool_pre_ping=True)
        self.engine: Engine = engine
        # Writes take SQLite's write lock at BEGIN: a deferred transaction that reads and
        # then writes can fail with "database is locked" at once, ignoring the busy timeout.
        self._write_engine = engine.execution_options(vmx_write=True)
        Base.metadata.create_all(engine)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _read(self):
        with Session(self.engine) as s, s.begin():
            yield s

    @contextmanager
    def _write(self):
        with Session(self._write_engine) as s, s.begin():
            yield s

    # ---- tenants -------------------------------------------------------------------------

    def create_tenant(self, name: str, quotas: dict | None = None) -> Tenant:
        _check_name(name)
        quotas = _check_json({} if quotas is None else quotas, "quotas")
        try:
            with self._write() as s:
                if s.scalar(select(TenantRow.id).where(TenantRow.name == name)):
                    raise InvalidInputError(f"tenant name {name!r} already exists")
                row = TenantRow(id=secrets.token_hex(6), name=name, created_at=time.time(),
                                disabled=False, quotas=quotas)
                s.add(row)
                s.flush()
                return _tenant(row)
        except IntegrityError:  # a concurrent create won the race (servers other than SQLite)
            raise InvalidInputError(f"tenant name {name!r} already exists") from None

    def get_tenant(self, tenant_id: str) -> Tenant | None:
        with self._read() as s:
            row = s.get(TenantRow, tenant_id)
            return _tenant(row) if row else None

    def tenant_by_name(self, name: str) -> Tenant | None:
        with self._read() as s:
            row = s.scalar(select(TenantRow).where(TenantRow.name == name))
            return _tenant(row) if row else None

    def list_tenants(self) -> list[Tenant]:
        with self._read() as s:
            return [_tenant(r) for r in s.scalars(select(TenantRow).order_by(TenantRow.created_at))]

    def set_disabled(self, tenant_id: str, disabled: bool) -> Tenant:
        with self._write() as s:
            row = _existing(s, TenantRow, tenant_id, "tenant")
            row.disabled = bool(disabled)
            return _tenant(row)

    def set_quotas(self, tenant_id: str, quotas: dict) -> Tenant:
        quotas = _check_json(quotas, "quotas")
        with self._write() as s:
            row = _existing(s, TenantRow, tenant_id, "tenant")
            row.quotas = quotas
            return _tenant(row)

    # ---- API keys ------------------------------------------------------------------------

    def create_key(self, tenant_id: str | None, name: str = "") -> tuple[ApiKey, str]:
        """A new key for `tenant_id` (None: an admin key). The secret is returned once, never stored."""
        _check_str(name, "name", allow_empty=True)
        with self._write() as s:
            if tenant_id is not None and s.get(TenantRow, tenant_id) is None:
                raise KeyError(f"no tenant {tenant_id!r}")
            key_id = secrets.token_hex(6)
            secret = f"vmx_{key_id}_{secrets.token_urlsafe(32)}"
            row = self._insert_key(s, key_id, tenant_id, name, secret)
            return _key(row), secret

    @staticmethod
    def _insert_key(s: Session, key_id: str, tenant_id: str | None, name: str, secret: str) -> ApiKeyRow:
        row = ApiKeyRow(id=key_id, tenant_id=tenant_id, name=name, secret_sha256=secret_digest(secret),
                        created_at=time.time(), revoked_at=None, last_used_at=None)
        s.add(row)
        s.flush()
        return row

    def authenticate(self, secret: str) -> ApiKey | None:
        """The key this secret belongs to, or None if unknown, revoked, or its tenant is disabled."""
        if not isinstance(secret, str) or not secret:
            return None
        digest = secret_digest(secret)  # lookup by hash: the secret itself is never compared or stored
        with self._read() as s:
            row = s.scalar(select(ApiKeyRow).where(ApiKeyRow.secret_sha256 == digest))
            if row is None or row.revoked_at is not None:
                return None
            if row.tenant_id is not None:
                tenant = s.get(TenantRow, row.tenant_id)
                if tenant is None or tenant.disabled:
                    return None
            key = _key(row)
        now = time.time()
        if key.last_used_at is None or now - key.last_used_at >= _LAST_USED_EVERY_S:
            with self._write() as s:
                s.get(ApiKeyRow, key.id).last_used_at = now
            key = ApiKey(key.id, key.tenant_id, key.name, key.created_at, key.revoked_at, now)
        return key

    def list_keys(self, tenant_id: str | None) -> list[ApiKey]:
        """The keys of `tenant_id` (None: the admin keys), revoked ones included."""
        with self._read() as s:
            q = select(ApiKeyRow).where(ApiKeyRow.tenant_id.is_(None) if tenant_id is None
                                        else ApiKeyRow.tenant_id == tenant_id)
            return [_key(r) for r in s.scalars(q.order_by(ApiKeyRow.created_at))]

    def revoke_key(self, key_id: str, tenant_id: str | None) -> bool:
        """Revoke a key of `tenant_id` (None: an admin key). False if no such key belongs to it."""
        with self._write() as s:
            row = s.get(ApiKeyRow, key_id)
            if row is None or row.tenant_id != tenant_id:
                return False  # another tenant's key looks exactly like a missing one
            if row.revoked_at is None:
                row.revoked_at = time.time()
            return True

    def ensure_admin_key(self, secret: str | None = None) -> str | None:
        """Make sure an admin key exists; return its secret if one was created now, else None.

        With `secret` (e.g. from an environment variable) that secret becomes a valid admin key.
        A secret that was revoked stays revoked: revocation must survive a restart.
        """
        if secret is not None:
            _check_str(secret, "secret")
        with self._write() as s:
            if secret is not None:
                row = s.scalar(select(ApiKeyRow).where(ApiKeyRow.secret_sha256 == secret_digest(secret)))
                if row is not None:
                    if row.tenant_id is not None:
                        raise InvalidInputError("secret is already a tenant's API key, not an admin key")
                    if row.revoked_at is not None:
                        log.warning("the configured admin secret (key %s) is revoked; not re-enabling it", row.id)
                    return None
                self._insert_key(s, secrets.token_hex(6), None, "admin", secret)
                return secret
            live = select(ApiKeyRow.id).where(ApiKeyRow.tenant_id.is_(None), ApiKeyRow.revoked_at.is_(None))
            if s.scalar(live.limit(1)) is not None:
                return None
            key_id = secrets.token_hex(6)
            secret = f"vmx_{key_id}_{secrets.token_urlsafe(32)}"
            self._insert_key(s, key_id, None, "admin", secret)
            return secret

    # ---- jobs ----------------------------------------------------------------------------

    def create_job(self, tenant_id: str, name: str, kind: str, spec: dict, workdir: str,
                   job_id: str | None = None) -> JobRecord:
        """`job_id`: the caller's id (the service names a job's workdir and slot by it before creating it)."""
        _check_str(name, "name")
        if job_id is not None:
            _check_str(job_id, "job_id")
        _check_str(kind, "kind")
        _check_str(workdir, "workdir")
        spec = _check_json(spec, "spec")
        with self._write() as s:
            if s.get(TenantRow, tenant_id) is None:
                raise KeyError(f"no tenant {tenant_id!r}")
            now = time.time()
            row = JobRow(id=job_id or secrets.token_hex(8), tenant_id=tenant_id, name=name, kind=kind, spec=spec,
                         state="queued", created_at=now, updated_at=now, error=None, result=None,
                         progress=None, workdir=workdir)
            s.add(row)
            s.flush()  # the event's FK needs the job row first (no ORM relationship orders them)
            s.add(JobEventRow(job_id=row.id, at=now, state="queued", detail="created"))
            return _job(row)

    def set_job_state(self, job_id: str, state: str, error: str | None = None,
                      result: dict | None = None, detail: str = "") -> JobRecord:
        """Move a job to `state` and log the transition. `error` replaces the job's error (None
        clears it, e.g. on a retry); `result` replaces the result only when given."""
        if state not in JOB_STATES:
            raise InvalidInputError(f"state must be one of {JOB_STATES}, got {state!r}")
        if error is not None:
            _check_str(error, "error", allow_empty=True)
        if result is not None:
            result = _check_json(result, "result")
        with self._write() as s:
            row = _existing(s, JobRow, job_id, "job")
            now = time.time()
            row.state, row.error, row.updated_at = state, error, now
            if result is not None:
                row.result = result
            s.add(JobEventRow(job_id=job_id, at=now, state=state, detail=detail or error or ""))
            return _job(row)

    def set_job_progress(self, job_id: str, progress: dict) -> None:
        progress = _check_json(progress, "progress")
        with self._write() as s:
            row = _existing(s, JobRow, job_id, "job")
            row.progress, row.updated_at = progress, time.time()

    def get_job(self, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
        """The job, or None if unknown or (with `tenant_id`) owned by another tenant."""
        with self._read() as s:
            row = s.get(JobRow, job_id)
            if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
                return None
            return _job(row)

    def list_jobs(self, tenant_id: str | None = None, states: Iterable[str] | None = None) -> list[JobRecord]:
        """Jobs, newest first; all tenants' when `tenant_id` is None."""
        states = _check_states(states)
        q = select(JobRow)
        if tenant_id is not None:
            q = q.where(JobRow.tenant_id == tenant_id)
        if states is not None:
            q = q.where(JobRow.state.in_(states))
        with self._read() as s:
            return [_job(r) for r in s.scalars(q.order_by(JobRow.created_at.desc(), JobRow.id.desc()))]

    def job_events(self, job_id: str) -> list[JobEvent]:
        with self._read() as s:
            rows = s.scalars(select(JobEventRow).where(JobEventRow.job_id == job_id).order_by(JobEventRow.id))
            return [JobEvent(r.id, r.job_id, r.at, r.state, r.detail) for r in rows]

    def unfinished_jobs(self) -> list[JobRecord]:
        """Queued or running jobs of every tenant, oldest first: what a restarted server resumes."""
        with self._read() as s:
            q = select(JobRow).where(JobRow.state.in_(UNFINISHED)).order_by(JobRow.created_at, JobRow.id)
            return [_job(r) for r in s.scalars(q)]

    def count_jobs(self, tenant_id: str, states: Iterable[str] | None = None) -> int:
        states = _check_states(states)
        q = select(func.count()).select_from(JobRow).where(JobRow.tenant_id == tenant_id)
        if states is not None:
            q = q.where(JobRow.state.in_(states))
        with self._read() as s:
            return int(s.scalar(q))

    # ---- checkpoints ---------------------------------------------------------------------

    def add_checkpoint(self, tenant_id: str, policy_id: str, policy_version: int, path: str, bytes: int,
                       sha256: str, job_id: str | None = None) -> CheckpointRecord:
        _check_str(policy_id, "policy_id")
        _check_str(path, "path")
        for arg, v in (("policy_version", policy_version), ("bytes", bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidInputError(f"{arg} must be a non-negative int, got {v!r}")
        if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256.lower()):
            raise InvalidInputError(f"sha256 must be 64 hex digits, got {sha256!r}")
        with self._write() as s:
            if s.get(TenantRow, tenant_id) is None:
                raise KeyError(f"no tenant {tenant_id!r}")
            if job_id is not None:
                job = s.get(JobRow, job_id)
                if job is None or job.tenant_id != tenant_id:
                    raise KeyError(f"no job {job_id!r}")
            row = CheckpointRow(id=secrets.token_hex(8), tenant_id=tenant_id, job_id=job_id,
                                policy_id=policy_id, policy_version=policy_version, path=path,
                                bytes=bytes, sha256=sha256.lower(), created_at=time.time())
            s.add(row)
            s.flush()
            return _checkpoint(row)

    def list_checkpoints(self, tenant_id: str, policy_id: str | None = None,
                         job_id: str | None = None) -> list[CheckpointRecord]:
        """A tenant's checkpoints, newest first."""
        q = select(CheckpointRow).where(CheckpointRow.tenant_id == tenant_id)
        if policy_id is not None:
            q = q.where(CheckpointRow.policy_id == policy_id)
        if job_id is not None:
            q = q.where(CheckpointRow.job_id == job_id)
        q = q.order_by(CheckpointRow.created_at.desc(), CheckpointRow.policy_version.desc())
        with self._read() as s:
            return [_checkpoint(r) for r in s.scalars(q)]

    def get_checkpoint(self, checkpoint_id: str, tenant_id: str) -> CheckpointRecord | None:
        with self._read() as s:
            row = s.get(CheckpointRow, checkpoint_id)
            return _checkpoint(row) if row is not None and row.tenant_id == tenant_id else None

    # ---- usage ---------------------------------------------------------------------------

    def record_usage(self, tenant_id: str, kind: str, amount: float, job_id: str | None = None) -> None:
        self.record_usage_many([(tenant_id, kind, amount, job_id)])

    def record_usage_many(self, rows: list[tuple[str, str, float, str | None]]) -> None:
        """Append usage rows in one transaction (all or none)."""
        now = time.time()
        objs = []
        for tenant_id, kind, amount, job_id in rows:
            _check_str(tenant_id, "tenant_id")
            _check_str(kind, "kind")
            if not isinstance(amount, (int, float)) or isinstance(amount, bool) or not math.isfinite(amount):
                raise InvalidInputError(f"amount must be a finite number, got {amount!r}")
            objs.append(UsageRow(tenant_id=tenant_id, kind=kind, amount=float(amount), job_id=job_id, at=now))
        if objs:
            with self._write() as s:
                s.add_all(objs)

    def usage_totals(self, tenant_id: str | None = None, since: float | None = None) -> UsageTotals:
        """Summed usage per tenant and kind, optionally of one tenant and from `since` on."""
        q = select(UsageRow.tenant_id, UsageRow.kind, func.sum(UsageRow.amount))
        if tenant_id is not None:
            q = q.where(UsageRow.tenant_id == tenant_id)
        if since is not None:
            q = q.where(UsageRow.at >= since)
        totals: UsageTotals = {}
        with self._read() as s:
            for tid, kind, total in s.execute(q.group_by(UsageRow.tenant_id, UsageRow.kind)):
                totals.setdefault(tid, {})[kind] = float(total)
        return totals


def _tune_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("vmx_write") else "BEGIN")
