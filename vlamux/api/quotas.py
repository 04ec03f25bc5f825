"""What each tenant holds of the service, reserved atomically with the check against its quotas.

A tenant's jobs, environment sessions, sub-envs and simulator processes are counted in one ledger
under one lock, so that a burst of parallel requests cannot all pass a check made before any of them
took its share (issue 16: 16 parallel session opens against a quota of 8 all succeeded). A job holds
what its spec can use at its peak (its RL sub-batches' sessions and worker processes, or its
evaluation's) from submission until it ends; an API session holds its envs and processes from the
request that opens it until it is closed or reaped.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, fields

# resource -> the quota that bounds it per tenant
QUOTA_OF = {"jobs": "max_concurrent_jobs", "slots": "max_training_slots", "sessions": "max_env_sessions",
            "envs": "max_envs", "processes": "max_env_processes"}
WHAT = {"jobs": "jobs running", "slots": "training slots", "sessions": "env sessions", "envs": "sub-envs",
        "processes": "simulator processes"}


@dataclass(frozen=True)
class Need:
    jobs: int = 0
    slots: int = 0
    sessions: int = 0
    envs: int = 0
    processes: int = 0

    def __add__(self, other: Need) -> Need:
        return Need(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Need)))

    def peak(self, other: Need) -> Need:
        """What either of two phases that never overlap needs at most."""
        return Need(*(max(getattr(self, f.name), getattr(other, f.name)) for f in fields(Need)))


def session_processes(n_envs: int, n_workers: int | None) -> int:
    """The worker processes a VectorEnv of n_envs starts (its default: one per env, up to the CPUs)."""
    return n_workers if n_workers is not None else max(1, min(n_envs, os.cpu_count() or 1))


class QuotaRefused(Exception):
    """Raised by `Ledger.reserve`: `resource` would go over `limit` (`scope` "tenant" or "service")."""

    def __init__(self, resource: str, held: int, asked: int, limit: int, scope: str):
        self.resource, self.held, self.asked, self.limit, self.scope = resource, held, asked, limit, scope
        if scope == "tenant":
            msg = (f"quota: {held} {WHAT[resource]} held and {asked} more asked; "
                   f"{QUOTA_OF[resource]} is {limit}")
        else:
            msg = f"the service is at capacity: {held} {WHAT[resource]} of {limit}, {asked} more asked"
        super().__init__(msg)


class Ledger:
    """Per tenant, the `Need` of each holder (a job id, a session id, a pending open), and the totals
    the whole service allows (`service_limits`: resource -> limit)."""

    def __init__(self, service_limits: dict[str, int] | None = None):
        self.service_limits = dict(service_limits or {})
        self._held: dict[str, dict[str, Need]] = {}
        self._lock = threading.Lock()

    def reserve(self, tenant: str, holder: str, need: Need, limits: dict, force: bool = False) -> None:
        """Record that `holder` of `tenant` holds `need`, if the tenant's `limits` (quota name ->
        value, None or absent: unbounded) and the service's allow it; else QuotaRefused and nothing
        is recorded. force: record it regardless (a job resumed after a restart was admitted before)."""
        with self._lock:
            mine = self._held.setdefault(tenant, {})
            if not force:
                held = sum(mine.values(), Need())
                total = sum((n for t in self._held.values() for n in t.values()), Need())
                for f in fields(Need):
                    asked = getattr(need, f.name)
                    if not asked:
                        continue
                    limit = limits.get(QUOTA_OF[f.name])
                    if limit is not None and getattr(held, f.name) + asked > int(limit):
                        raise QuotaRefused(f.name, getattr(held, f.name), asked, int(limit), "tenant")
                    cap = self.service_limits.get(f.name)
                    if cap is not None and getattr(total, f.name) + asked > cap:
                        raise QuotaRefused(f.name, getattr(total, f.name), asked, cap, "service")
            mine[holder] = mine.get(holder, Need()) + need

    def rename(self, tenant: str, old: str, new: str) -> None:
        with self._lock:
            mine = self._held.get(tenant, {})
            if old in mine:
                mine[new] = mine.pop(old)

    def release(self, tenant: str, holder: str) -> None:
        with self._lock:
            self._held.get(tenant, {}).pop(holder, None)

    def keep_only(self, tenant: str, prefix: str, alive: set[str]) -> None:
        """Drop the tenant's holders named `prefix` + id whose id is not in `alive` (sessions the
        Environment Service reaped or lost)."""
        with self._lock:
            mine = self._held.get(tenant, {})
            for h in [h for h in mine if h.startswith(prefix) and h[len(prefix):] not in alive]:
                del mine[h]

    def held(self, tenant: str) -> Need:
        with self._lock:
            return sum(self._held.get(tenant, {}).values(), Need())
