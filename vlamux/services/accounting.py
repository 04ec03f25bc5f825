"""Who used how much: per-service busy time against wall time, per-tenant compute.

A group's backbone time is split over its tenants by their share of rows;
each tenant's own head time counts in full (the runner's `Result` carries both).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque


class Accounting:
    def __init__(self):
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.group_s: deque[float] = deque(maxlen=4096)  # the latest groups' durations, for percentiles
        self.tenants: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def busy(self, seconds: float) -> None:
        with self._lock:
            self.busy_s += seconds
            self.group_s.append(seconds)

    def charge(self, tenant: str, **amounts: float) -> None:
        with self._lock:
            for k, v in amounts.items():
                self.tenants[tenant][k] += v

    def reset(self) -> None:
        with self._lock:
            self.started, self.busy_s = time.monotonic(), 0.0
            self.tenants.clear()

    def utilization(self) -> float:
        wall = time.monotonic() - self.started
        return self.busy_s / wall if wall > 0 else 0.0

    def usage(self, tenant: str) -> dict[str, float]:
        with self._lock:
            return dict(self.tenants.get(tenant, {}))

    def snapshot(self) -> dict:
        with self._lock:
            return {"busy_s": self.busy_s, "wall_s": time.monotonic() - self.started,
                    "utilization": self.utilization(),
                    "tenants": {t: dict(v) for t, v in self.tenants.items()}}
