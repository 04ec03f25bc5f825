"""Who used how much: per-service busy time against wall time, per-tenant compute.

A group's backbone time is split over its tenants by their share of rows;
each tenant's own head time counts in full (the runner's `Result` carries both).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque


IDLE_S = 600.0  # a key charged nothing this long leaves `tenants` (the Meter has long recorded it)


class Accounting:
    """`tenants`: cumulative amounts per tenant key (a job's or a slot's, "tenant/policy"), for the Meter,
    which records their growth in the store every fraction of a second. Keys idle for IDLE_S go, so
    a service that runs jobs all day holds the keys of recent ones, not of every job it ran; one
    charged again starts from zero (the Meter takes a key that came back as new)."""

    def __init__(self, idle_s: float = IDLE_S):
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.group_s: deque[float] = deque(maxlen=4096)  # the latest groups' durations, for percentiles
        self.tenants: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.idle_s = idle_s
        self._charged: dict[str, float] = {}  # key -> when last charged (monotonic), oldest first

    def busy(self, seconds: float) -> None:
        with self._lock:
            self.busy_s += seconds
            self.group_s.append(seconds)

    def charge(self, tenant: str, **amounts: float) -> None:
        with self._lock:
            for k, v in amounts.items():
                self.tenants[tenant][k] += v
            self._charged.pop(tenant, None)  # to the end: the dict stays in order of last charge
            self._charged[tenant] = time.monotonic()

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.idle_s
        while self._charged:
            key, at = next(iter(self._charged.items()))
            if at > cutoff:
                return
            del self._charged[key]
            self.tenants.pop(key, None)

    def reset(self) -> None:
        with self._lock:
            self.started, self.busy_s = time.monotonic(), 0.0
            self.tenants.clear()
            self._charged.clear()

    def utilization(self) -> float:
        wall = time.monotonic() - self.started
        return self.busy_s / wall if wall > 0 else 0.0

    def usage(self, tenant: str) -> dict[str, float]:
        with self._lock:
            return dict(self.tenants.get(tenant, {}))

    def snapshot(self) -> dict:
        with self._lock:
            self._expire()
            return {"busy_s": self.busy_s, "wall_s": time.monotonic() - self.started,
                    "utilization": self.utilization(),
                    "tenants": {t: dict(v) for t, v in self.tenants.items()}}
