"""What each tenant holds of the service, reserved atomically with the check against its quotas.

A tenant's jobs, environment sessions, sub-envs and simulator processes are counted in one ledger
under one lock, so that a burst of parallel requests cannot all pass a check made before any of them
took its share (issue 16: 16 parallel session opens against a quota of 8 all succeeded). A job holds
what its spec can use at its peak (its RL sub-batches' sessions and worker processes, or its
evaluation's) from submission until it ends; an API session holds its envs and processes from the
request that opens it until it is closed or reaped.

A holder counts towards the service-wide limits only once admitted: a job the service has no room
for yet holds its tenant's share (so a tenant's queued and running jobs together stay within its
quota) while it waits in the job queue (vlamux.api.job_queue), and is admitted when it starts.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, fields
from typing import Callable

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

    def numbers(self) -> dict:
        """What a client needs to decide when to ask again: the resource, the limit and its name."""
        return {"resource": self.resource, "held": self.held, "asked": self.asked, "limit": self.limit,
                "scope": self.scope, **({"quota": QUOTA_OF[self.resource]} if self.scope == "tenant" else {})}


class Ledger:
    """Per tenant, the `Need` of each holder (a job id, a session id, a pending open), and the totals
    the whole service allows (`service_limits`: resource -> limit). `on_release` is called (outside
    the lock) whenever something was given back: the job queue starts what now fits."""

    def __init__(self, service_limits: dict[str, int] | None = None):
        self.service_limits = {k: v for k, v in (service_limits or {}).items() if v is not None}
        self._held: dict[str, dict[str, Need]] = {}
        self._waiting: set[tuple[str, str]] = set()  # (tenant, holder) not yet admitted to the service
        self._lock = threading.Lock()
        self.on_release: Callable[[], None] | None = None

    def reserve(self, tenant: str, holder: str, need: Need, limits: dict, force: bool = False,
                admit: bool = True) -> None:
        """Record that `holder` of `tenant` holds `need`, if the tenant's `limits` (quota name ->
        value, None or absent: unbounded) and, when `admit`, the service's allow it; else QuotaRefused
        and nothing is recorded. admit=False: it holds the tenant's share only, until `admit`.
        force: record it regardless (a job resumed after a restart was admitted before)."""
        with self._lock:
            mine = self._held.setdefault(tenant, {})
            if not force:
                held = sum(mine.values(), Need())
                for f in fields(Need):
                    asked, limit = getattr(need, f.name), limits.get(QUOTA_OF[f.name])
                    if asked and limit is not None and getattr(held, f.name) + asked > int(limit):
                        raise QuotaRefused(f.name, getattr(held, f.name), asked, int(limit), "tenant")
                if admit:
                    self._check_service(need)
            mine[holder] = mine.get(holder, Need()) + need
            if not admit:
                self._waiting.add((tenant, holder))

    def admit(self, tenant: str, holder: str) -> None:
        """Count a waiting holder towards the service's limits, if they allow it; else QuotaRefused."""
        with self._lock:
            if (tenant, holder) not in self._waiting:
                return
            self._check_service(self._held[tenant][holder])
            self._waiting.discard((tenant, holder))

    def _check_service(self, need: Need) -> None:
        total = self._admitted()
        for resource, cap in self.service_limits.items():
            asked = getattr(need, resource)
            if asked and getattr(total, resource) + asked > cap:
                raise QuotaRefused(resource, getattr(total, resource), asked, cap, "service")

    def _admitted(self, prefix: str | None = None) -> Need:
        return sum((n for t, mine in self._held.items() for h, n in mine.items()
                    if (t, h) not in self._waiting and (prefix is None or h.startswith(prefix))), Need())

    def service_use(self, prefix: str | None = None) -> Need:
        """What admitted holders (named `prefix`..., or all) hold across tenants."""
        with self._lock:
            return self._admitted(prefix)

    def rename(self, tenant: str, old: str, new: str) -> None:
        with self._lock:
            mine = self._held.get(tenant, {})
            if old in mine:
                mine[new] = mine.pop(old)
                if (tenant, old) in self._waiting:
                    self._waiting.discard((tenant, old))
                    self._waiting.add((tenant, new))

    def release(self, tenant: str, holder: str) -> None:
        with self._lock:
            self._held.get(tenant, {}).pop(holder, None)
            self._waiting.discard((tenant, holder))
        self._released()

    def _released(self) -> None:
        if self.on_release is not None:
            self.on_release()

    def keep_only(self, tenant: str, prefix: str, alive: set[str]) -> None:
        """Drop the tenant's holders named `prefix` + id whose id is not in `alive` (sessions the
        Environment Service reaped or lost)."""
        with self._lock:
            mine = self._held.get(tenant, {})
            gone = [h for h in mine if h.startswith(prefix) and h[len(prefix):] not in alive]
            for h in gone:
                del mine[h]
                self._waiting.discard((tenant, h))
        if gone:
            self._released()

    def held(self, tenant: str) -> Need:
        with self._lock:
            return sum(self._held.get(tenant, {}).values(), Need())
