"""Tenant-scoped handles: the Environment Service's sessions and datasets as a registry.

A handle belongs to one tenant, and a tenant only ever reaches its own: another tenant's id is
answered exactly like an id that never existed (`SessionNotFound`, `DatasetNotFound`). Each handle has
its own lock, held by the call running on it; the registry's lock guards the tables, the counters and
the tombstones (the reason an id is gone: closed, or expired after its idle timeout) and is never held
across a call on a handle.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass, field

from vlamux.errors import VlamuxError

TOMBSTONES = 4096  # how many closed/expired handles are remembered (for "expired" messages)
KINDS = ("session", "dataset")


class NotFound(VlamuxError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class SessionNotFound(NotFound):
    """No such session for this tenant (never existed, closed, expired, or another tenant's)."""


class DatasetNotFound(NotFound):
    """No such dataset handle for this tenant."""


class QuotaExceeded(VlamuxError):
    """A per-tenant or service-wide limit would be exceeded."""


class SessionBusy(VlamuxError, TimeoutError):
    """Another call on the same session or dataset did not finish within the wait bound."""


class ServiceClosed(VlamuxError, RuntimeError):
    """The service has been shut down."""


@dataclass
class Counters:
    env_steps: int = 0
    step_calls: int = 0
    reset_calls: int = 0
    episodes_started: int = 0  # sub-env resets that succeeded
    sim_s: float = 0.0  # time inside simulator calls
    errors: int = 0  # simulator calls that raised
    samples: int = 0  # dataset rows handed out
    sample_calls: int = 0
    sample_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def add(self, **inc) -> None:
        for k, v in inc.items():
            setattr(self, k, getattr(self, k) + v)


@dataclass(kw_only=True)
class Handle:
    """What every handle has: its id and tenant, its lock, its idle timeout and last use, its counters."""

    KIND = ""

    id: str
    tenant: str
    idle_timeout_s: float | None
    created: float  # wall clock (time.time())
    last_used_mono: float
    last_used: float  # wall clock
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    counters: Counters = field(default_factory=Counters)

    @property
    def wait_bound_s(self) -> float:
        """How long a call may wait for an earlier call on this handle."""
        raise NotImplementedError

    @property
    def resource(self):
        """What closing the handle closes (a session's simulators, a dataset's reader)."""
        raise NotImplementedError


class Handles:
    """Every tenant's sessions and datasets, with quotas' pending opens, tombstones and usage."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tables: dict[str, dict[str, Handle]] = {k: {} for k in KINDS}
        # opens under way, per tenant (sessions, envs, datasets): a quota counts them before they land
        self.pending: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        self.usage: dict[str, Counters] = collections.defaultdict(Counters)
        self.events = collections.Counter({f"{k}s_{e}": 0 for k in KINDS for e in ("opened", "closed", "reaped")})
        self.closed = False
        self._gone: collections.OrderedDict[tuple[str, str, str], str] = collections.OrderedDict()

    # ---- with `lock` held ----------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise ServiceClosed("the environment service is closed")

    def owned(self, kind: str, tenant: str) -> list[Handle]:
        return [h for h in self.tables[kind].values() if h.tenant == tenant]

    def add(self, h: Handle) -> None:
        self.check_open()
        self.tables[h.KIND][h.id] = h
        self.events[f"{h.KIND}s_opened"] += 1

    def _drop(self, h: Handle, why: str, event: str) -> None:
        h.closed = True
        self.tables[h.KIND].pop(h.id, None)
        self._gone[(h.KIND, h.tenant, h.id)] = why
        while len(self._gone) > TOMBSTONES:
            self._gone.popitem(last=False)
        self.events[f"{h.KIND}s_{event}"] += 1

    def _not_found(self, kind: str, tenant: str, hid) -> NotFound:
        err = SessionNotFound if kind == "session" else DatasetNotFound
        why = self._gone.get((kind, tenant, hid)) if isinstance(hid, str) else None
        return err(why or f"tenant {tenant!r} has no {kind} {hid!r}")

    # ---- taking the lock themselves --------------------------------------------------------------------
    def mine(self, kind: str, tenant: str) -> list[Handle]:
        """The tenant's open handles of `kind`, oldest first."""
        with self.lock:
            return sorted(self.owned(kind, tenant), key=lambda h: h.created)

    def lookup(self, kind: str, tenant: str, hid) -> Handle:
        with self.lock:
            self.check_open()
            h = self.tables[kind].get(hid) if isinstance(hid, str) else None
            if h is None or h.tenant != tenant:  # someone else's id reads exactly like an unknown one
                raise self._not_found(kind, tenant, hid)
            return h

    def acquire(self, kind: str, tenant: str, hid) -> Handle:
        """The handle with its lock held (released by `release`), after a bounded wait for a running call."""
        h = self.lookup(kind, tenant, hid)
        if not h.lock.acquire(timeout=h.wait_bound_s):
            raise SessionBusy(f"{kind} {h.id!r} is busy: another call on it did not finish within "
                              f"{h.wait_bound_s:.0f}s")
        if h.closed:  # closed or reaped while we waited
            h.lock.release()
            with self.lock:
                raise self._not_found(kind, h.tenant, h.id)
        h.last_used_mono, h.last_used = time.monotonic(), time.time()
        return h

    @staticmethod
    def release(h: Handle) -> None:
        h.last_used_mono, h.last_used = time.monotonic(), time.time()
        h.lock.release()

    def close(self, h: Handle) -> None:
        """Close `h`, acquired by the caller (whose lock this releases): its id is then unknown."""
        try:
            with self.lock:
                self._drop(h, f"{h.KIND} {h.id!r} was closed", "closed")
        finally:
            h.lock.release()

    def count(self, h: Handle, **inc) -> None:
        with self.lock:
            h.counters.add(**inc)
            self.usage[h.tenant].add(**inc)

    def expired(self, now: float) -> list[Handle]:
        """Take out every handle unused for longer than its idle timeout (one with a call in progress is
        in use, never idle); the caller closes what they hold."""
        out = []
        with self.lock:
            for table in self.tables.values():
                for h in list(table.values()):
                    if h.idle_timeout_s is None or now - h.last_used_mono <= h.idle_timeout_s:
                        continue
                    if not h.lock.acquire(blocking=False):  # a call is running on it
                        continue
                    try:
                        self._drop(h, f"{h.KIND} {h.id!r} expired: unused for more than {h.idle_timeout_s:g}s "
                                      f"(its idle timeout) and was closed; open a new one", "reaped")
                    finally:
                        h.lock.release()
                    out.append(h)
        return out

    def close_all(self) -> list[Handle] | None:
        """Mark the registry closed and take out every handle; None if it was closed already."""
        with self.lock:
            if self.closed:
                return None
            self.closed = True
            out = [h for table in self.tables.values() for h in table.values()]
            for table in self.tables.values():
                table.clear()
        return out

    # ---- accounting --------------------------------------------------------------------------------------
    def tenants(self) -> list[str]:
        with self.lock:
            return sorted(set(self.usage) | {h.tenant for h in self.tables["session"].values()})

    def env_steps(self) -> dict[str, int]:
        with self.lock:
            return {t: c.env_steps for t, c in self.usage.items()}

    def usage_of(self, tenant: str) -> dict:
        """The tenant's totals (closed handles included) and per open handle."""
        with self.lock:
            total = self.usage[tenant].as_dict() if tenant in self.usage else Counters().as_dict()
            sessions = {h.id: h.counters.as_dict() for h in self.owned("session", tenant)}
            datasets = {h.id: h.counters.as_dict() for h in self.owned("dataset", tenant)}
            envs = sum(h.n_envs for h in self.owned("session", tenant))
        return {**total, "open_sessions": len(sessions), "open_envs": envs, "open_datasets": len(datasets),
                "sessions": sessions, "datasets": datasets}

    def totals(self) -> dict:
        """Open handles, totals over all tenants, and lifecycle events."""
        with self.lock:
            totals = Counters()
            for c in self.usage.values():
                totals.add(**c.as_dict())
            return {"open_sessions": len(self.tables["session"]),
                    "open_envs": sum(h.n_envs for h in self.tables["session"].values()),
                    "open_datasets": len(self.tables["dataset"]), "tenants": len(self.usage),
                    **{f"total_{k}": v for k, v in totals.as_dict().items()}, **dict(self.events)}
