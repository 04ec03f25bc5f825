"""Persistent store of the tenant-facing service: tenants, API keys, jobs, training slots, checkpoints, usage.

One short session per call, so any number of server threads can share a
`Store`. Every method returns frozen dataclasses, never ORM objects.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, delete, event, func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from vlamux.errors import InvalidInputError
from vlamux.store import usage
from vlamux.store.models import ApiKeyRow, Base, CheckpointRow, JobEventRow, JobRow, SlotRow, TenantRow, UsageRow
from vlamux.store.records import (
    JOB_STATES,
    SLOT_LIVE,
    SLOT_STATES,
    UNFINISHED,
    SHA256,
    ApiKey,
    CheckpointRecord,
    JobEvent,
    JobRecord,
    SlotRecord,
    Tenant,
    UsageTotals,
    check_json,
    check_name,
    check_states,
    check_str,
    existing,
    secret_digest,
    to_checkpoint,
    to_job,
    to_key,
    to_slot,
    to_tenant,
)

_LAST_USED_EVERY_S = 60.0  # authenticate writes last_used_at at most this often per key

log = logging.getLogger(__name__)


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
        self._move_slot_jobs()

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
        check_name(name)
        quotas = check_json({} if quotas is None else quotas, "quotas")
        try:
            with self._write() as s:
                if s.scalar(select(TenantRow.id).where(TenantRow.name == name)):
                    raise InvalidInputError(f"tenant name {name!r} already exists")
                row = TenantRow(id=secrets.token_hex(6), name=name, created_at=time.time(),
                                disabled=False, quotas=quotas)
                s.add(row)
                s.flush()
                return to_tenant(row)
        except IntegrityError:  # a concurrent create won the race (servers other than SQLite)
            raise InvalidInputError(f"tenant name {name!r} already exists") from None

    def get_tenant(self, tenant_id: str) -> Tenant | None:
        with self._read() as s:
            row = s.get(TenantRow, tenant_id)
            return to_tenant(row) if row else None

    def tenant_by_name(self, name: str) -> Tenant | None:
        with self._read() as s:
            row = s.scalar(select(TenantRow).where(TenantRow.name == name))
            return to_tenant(row) if row else None

    def list_tenants(self) -> list[Tenant]:
        with self._read() as s:
            return [to_tenant(r) for r in s.scalars(select(TenantRow).order_by(TenantRow.created_at))]

    def set_disabled(self, tenant_id: str, disabled: bool) -> Tenant:
        with self._write() as s:
            row = existing(s, TenantRow, tenant_id, "tenant")
            row.disabled = bool(disabled)
            return to_tenant(row)

    def set_quotas(self, tenant_id: str, quotas: dict) -> Tenant:
        quotas = check_json(quotas, "quotas")
        with self._write() as s:
            row = existing(s, TenantRow, tenant_id, "tenant")
            row.quotas = quotas
            return to_tenant(row)

    # ---- API keys ------------------------------------------------------------------------

    def create_key(self, tenant_id: str | None, name: str = "") -> tuple[ApiKey, str]:
        """A new key for `tenant_id` (None: an admin key). The secret is returned once, never stored."""
        check_str(name, "name", allow_empty=True)
        with self._write() as s:
            if tenant_id is not None and s.get(TenantRow, tenant_id) is None:
                raise KeyError(f"no tenant {tenant_id!r}")
            key_id = secrets.token_hex(6)
            secret = f"vmx_{key_id}_{secrets.token_urlsafe(32)}"
            row = self._insert_key(s, key_id, tenant_id, name, secret)
            return to_key(row), secret

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
            key = to_key(row)
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
            return [to_key(r) for r in s.scalars(q.order_by(ApiKeyRow.created_at))]

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
            check_str(secret, "secret")
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
        check_str(name, "name")
        if job_id is not None:
            check_str(job_id, "job_id")
        check_str(kind, "kind")
        check_str(workdir, "workdir")
        spec = check_json(spec, "spec")
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
            return to_job(row)

    def set_job_state(self, job_id: str, state: str, error: str | None = None,
                      result: dict | None = None, detail: str = "") -> JobRecord:
        """Move a job to `state` and log the transition. `error` replaces the job's error (None
        clears it, e.g. on a retry); `result` replaces the result only when given."""
        if state not in JOB_STATES:
            raise InvalidInputError(f"state must be one of {JOB_STATES}, got {state!r}")
        if error is not None:
            check_str(error, "error", allow_empty=True)
        if result is not None:
            result = check_json(result, "result")
        with self._write() as s:
            row = existing(s, JobRow, job_id, "job")
            now = time.time()
            row.state, row.error, row.updated_at = state, error, now
            if result is not None:
                row.result = result
            s.add(JobEventRow(job_id=job_id, at=now, state=state, detail=detail or error or ""))
            return to_job(row)

    def set_job_progress(self, job_id: str, progress: dict) -> None:
        progress = check_json(progress, "progress")
        with self._write() as s:
            row = existing(s, JobRow, job_id, "job")
            row.progress, row.updated_at = progress, time.time()

    def get_job(self, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
        """The job, or None if unknown or (with `tenant_id`) owned by another tenant."""
        with self._read() as s:
            row = s.get(JobRow, job_id)
            if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
                return None
            return to_job(row)

    def list_jobs(self, tenant_id: str | None = None, states: Iterable[str] | None = None) -> list[JobRecord]:
        """Jobs, newest first; all tenants' when `tenant_id` is None."""
        states = check_states(states)
        q = select(JobRow)
        if tenant_id is not None:
            q = q.where(JobRow.tenant_id == tenant_id)
        if states is not None:
            q = q.where(JobRow.state.in_(states))
        with self._read() as s:
            return [to_job(r) for r in s.scalars(q.order_by(JobRow.created_at.desc(), JobRow.id.desc()))]

    def job_events(self, job_id: str) -> list[JobEvent]:
        with self._read() as s:
            rows = s.scalars(select(JobEventRow).where(JobEventRow.job_id == job_id).order_by(JobEventRow.id))
            return [JobEvent(r.id, r.job_id, r.at, r.state, r.detail) for r in rows]

    def unfinished_jobs(self) -> list[JobRecord]:
        """Queued or running jobs of every tenant, oldest first: what a restarted server resumes."""
        with self._read() as s:
            q = select(JobRow).where(JobRow.state.in_(UNFINISHED)).order_by(JobRow.created_at, JobRow.id)
            return [to_job(r) for r in s.scalars(q)]

    def job_counts(self) -> dict[str, int]:
        """Jobs on record by state, all tenants'."""
        with self._read() as s:
            return {state: int(n) for state, n in s.execute(select(JobRow.state, func.count()).group_by(JobRow.state))}

    def count_jobs(self, tenant_id: str, states: Iterable[str] | None = None) -> int:
        states = check_states(states)
        q = select(func.count()).select_from(JobRow).where(JobRow.tenant_id == tenant_id)
        if states is not None:
            q = q.where(JobRow.state.in_(states))
        with self._read() as s:
            return int(s.scalar(q))

    def prune_jobs(self, tenant_id: str, keep: int, spare: Iterable[str] = ()) -> list[JobRecord]:
        """A tenant's finished jobs past its `keep` most recent (by creation) leave the store: their
        record, events and checkpoints' records (the caller removes their files). Their usage stays in
        the tenant's totals, no longer by job. spare: job ids kept whatever their age (policies being
        served). Returns the jobs removed."""
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise InvalidInputError(f"keep must be a non-negative int, got {keep!r}")
        spare = set(spare)
        q = (select(JobRow).where(JobRow.tenant_id == tenant_id, JobRow.state.not_in(UNFINISHED))
             .order_by(JobRow.created_at.desc(), JobRow.id.desc()).offset(keep))
        with self._write() as s:
            rows = [r for r in s.scalars(q) if r.id not in spare]
            if not rows:
                return []
            ids = [r.id for r in rows]
            gone = [to_job(r) for r in rows]
            usage.fold_jobs(s, tenant_id, ids)
            s.execute(delete(JobEventRow).where(JobEventRow.job_id.in_(ids)))
            s.execute(delete(CheckpointRow).where(CheckpointRow.job_id.in_(ids)))
            s.execute(delete(JobRow).where(JobRow.id.in_(ids)))
            return gone

    # ---- training slots ------------------------------------------------------------------

    def create_slot(self, tenant_id: str, slot_id: str, name: str, spec: dict, workdir: str) -> SlotRecord:
        for arg, v in (("slot_id", slot_id), ("name", name), ("workdir", workdir)):
            check_str(v, arg)
        spec = check_json(spec, "spec")
        with self._write() as s:
            if s.get(TenantRow, tenant_id) is None:
                raise KeyError(f"no tenant {tenant_id!r}")
            now = time.time()
            row = SlotRow(id=slot_id, tenant_id=tenant_id, name=name, spec=spec, state="creating", created_at=now,
                          updated_at=now, error=None, workdir=workdir)
            s.add(row)
            s.flush()
            return to_slot(row)

    def set_slot_state(self, slot_id: str, state: str, error: str | None = None) -> SlotRecord:
        if state not in SLOT_STATES:
            raise InvalidInputError(f"state must be one of {SLOT_STATES}, got {state!r}")
        if error is not None:
            check_str(error, "error", allow_empty=True)
        with self._write() as s:
            row = existing(s, SlotRow, slot_id, "training slot")
            row.state, row.error, row.updated_at = state, error, time.time()
            return to_slot(row)

    def get_slot(self, slot_id: str, tenant_id: str | None = None) -> SlotRecord | None:
        """The slot, or None if unknown or (with `tenant_id`) owned by another tenant."""
        with self._read() as s:
            row = s.get(SlotRow, slot_id)
            if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
                return None
            return to_slot(row)

    def list_slots(self, tenant_id: str | None = None, states: Iterable[str] | None = None) -> list[SlotRecord]:
        """Slots, oldest first; all tenants' when `tenant_id` is None."""
        states = check_states(states, SLOT_STATES)
        q = select(SlotRow)
        if tenant_id is not None:
            q = q.where(SlotRow.tenant_id == tenant_id)
        if states is not None:
            q = q.where(SlotRow.state.in_(states))
        with self._read() as s:
            return [to_slot(r) for r in s.scalars(q.order_by(SlotRow.created_at, SlotRow.id))]

    def live_slots(self) -> list[SlotRecord]:
        """Every tenant's slots that are being created or ready: what a restarted server restores."""
        return self.list_slots(states=SLOT_LIVE)

    def _move_slot_jobs(self) -> None:
        """Stores written before slots had their table kept them as jobs of kind "slot": move them
        over, same id, spec and workdir (their checkpoints name the slot by policy_id, not job_id)."""
        states = {"queued": "creating", "running": "ready", "failed": "failed"}
        with self._read() as s:  # every start: a read, the write lock only when there is something to move
            if s.scalar(select(JobRow.id).where(JobRow.kind == "slot").limit(1)) is None:
                return
        with self._write() as s:
            old = list(s.scalars(select(JobRow).where(JobRow.kind == "slot")))
            if not old:
                return
            ids = [r.id for r in old]
            for r in old:
                s.add(SlotRow(id=r.id, tenant_id=r.tenant_id, name=r.name, spec=r.spec,
                              state=states.get(r.state, "deleted"), created_at=r.created_at,
                              updated_at=r.updated_at, error=r.error, workdir=r.workdir))
            s.execute(update(UsageRow).where(UsageRow.job_id.in_(ids)).values(job_id=None))
            s.execute(update(CheckpointRow).where(CheckpointRow.job_id.in_(ids)).values(job_id=None))
            s.execute(delete(JobEventRow).where(JobEventRow.job_id.in_(ids)))
            s.flush()
            s.execute(delete(JobRow).where(JobRow.id.in_(ids)))
        log.info("moved %d training slots from the jobs table to their own", len(ids))

    # ---- checkpoints ---------------------------------------------------------------------

    def add_checkpoint(self, tenant_id: str, policy_id: str, policy_version: int, path: str, bytes: int,
                       sha256: str, job_id: str | None = None) -> CheckpointRecord:
        check_str(policy_id, "policy_id")
        check_str(path, "path")
        for arg, v in (("policy_version", policy_version), ("bytes", bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidInputError(f"{arg} must be a non-negative int, got {v!r}")
        if not isinstance(sha256, str) or not SHA256.fullmatch(sha256.lower()):
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
            return to_checkpoint(row)

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
            return [to_checkpoint(r) for r in s.scalars(q)]

    def get_checkpoint(self, checkpoint_id: str, tenant_id: str) -> CheckpointRecord | None:
        with self._read() as s:
            row = s.get(CheckpointRow, checkpoint_id)
            return to_checkpoint(row) if row is not None and row.tenant_id == tenant_id else None

    # ---- usage ---------------------------------------------------------------------------

    def record_usage(self, tenant_id: str, kind: str, amount: float, job_id: str | None = None) -> None:
        self.record_usage_many([(tenant_id, kind, amount, job_id)])

    def record_usage_many(self, rows: list[tuple[str, str, float, str | None]]) -> None:
        """Add usage in one transaction (all or none), rolled up by the hour (`vlamux.store.usage`)."""
        now = time.time()
        sums: dict[tuple[str, str, str | None], float] = {}
        for tenant_id, kind, amount, job_id in rows:
            check_str(tenant_id, "tenant_id")
            check_str(kind, "kind")
            if not isinstance(amount, (int, float)) or isinstance(amount, bool) or not math.isfinite(amount):
                raise InvalidInputError(f"amount must be a finite number, got {amount!r}")
            sums[(tenant_id, kind, job_id)] = sums.get((tenant_id, kind, job_id), 0.0) + float(amount)
        if sums:
            with self._write() as s:
                usage.add(s, sums, now)

    def usage_totals(self, tenant_id: str | None = None, since: float | None = None) -> UsageTotals:
        """Summed usage per tenant and kind, optionally of one tenant and from `since` on (to the hour:
        usage is kept by the hour)."""
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
