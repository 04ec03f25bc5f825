"""Usage metering and request-rate limits.

The services count per slot (``<tenant>/<policy>``) what each tenant used: a group's backbone time
split by its rows, the tenant's own head time, requests, and env steps. The `Meter` turns the growth
of those counters into usage records in the store every few seconds, per tenant: the basis for
charging tenants for what they used rather than for machine-hours.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the contract, for annotations only
    from vlamux.services.contract import Runtime

log = logging.getLogger(__name__)

KINDS = ("backbone_s", "head_s", "requests", "env_steps")


def service_counters(runtime: Runtime) -> dict[tuple[str, str], dict[str, float]]:
    """Cumulative counters per (service, tenant key): each service's own, so that one letting an idle
    key go (vlamux.services.accounting) leaves the others' counts of it as they were."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for service, snapshot in runtime.accounting().items():  # the training service's and each replica's
        for key, amounts in snapshot["tenants"].items():
            out[(service, key)] = {kind: amounts.get(kind, 0.0) for kind in ("backbone_s", "head_s", "requests")}
    for key, steps in runtime.environment.env_steps().items():  # one call, however many tenants
        out[("environment", key)] = {"env_steps": steps}
    return out


ON_RECORD_MAX = 10_000  # names the Meter remembers as on record


class Meter:
    """Every `every_s`, records each tenant's usage since the last tick in the store: a service killed
    outright loses at most that much (plus a tick's own time) of what it metered."""

    def __init__(self, host, every_s: float = 0.25):
        self.host, self.every_s = host, every_s
        self._last: dict[str, dict[str, float]] = {}
        # tenants and jobs the store has had (a job pruned from the history since: the store files its
        # usage under the tenant alone)
        self._on_record: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vlamux-meter", daemon=True)

    def start(self) -> Meter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        try:
            self.tick()  # what accrued since the last tick is not lost
        except Exception:  # noqa: BLE001 - stopping must go on
            log.exception("final metering tick failed")

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - metering must not take the service down
                log.exception("metering tick failed")

    def tick(self) -> int:
        counters = service_counters(self.host.runtime)
        rows, seen = [], {}
        for (service, key), amounts in counters.items():
            last = self._last.get((service, key), {})
            deltas = {}
            for kind, total in amounts.items():
                delta = total - last.get(kind, 0.0)
                if delta < 0:  # a restarted service starts its counters again from zero
                    delta = total
                if delta > 0:
                    deltas[kind] = delta
            seen[(service, key)] = dict(amounts)
            if not deltas:  # nothing new: no store lookup either (a tick is a few lookups, not one a slot)
                continue
            tenant, _, policy = key.partition("/")
            if not self._known("tenant", tenant):  # not a tenant of the API (e.g. a bench's own slot)
                continue
            # A usage row names its job only when that job is on record: a slot whose creation
            # failed may still have been charged for the attempt.
            job = policy if policy and self._known("job", policy, tenant) else None
            rows += [(tenant, kind, delta, job) for kind, delta in deltas.items()]
        if rows:
            self.host.store.record_usage_many(rows)
        # only once written: a failed write is retried at the next tick. Keys the services no longer
        # report (idle ones they let go) go here too; one that comes back counts from zero
        self._last = seen
        if len(self._on_record) > ON_RECORD_MAX:  # a day of jobs: looked up again as they are charged
            self._on_record.clear()
        return len(rows)

    def _known(self, kind: str, key: str, tenant: str | None = None) -> bool:
        name = f"{kind}:{key}"
        if name in self._on_record:
            return True
        store = self.host.store
        found = store.get_tenant(key) is not None if kind == "tenant" else store.get_job(key, tenant) is not None
        if found:
            self._on_record.add(name)
        return found


class RateLimiter:
    """A token bucket per tenant: `rate` requests per second, bursts of up to 2 s worth."""

    def __init__(self):
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str, rate: float) -> float:
        """0 if admitted, else the seconds until a request would be."""
        now = time.monotonic()
        burst = max(1.0, 2.0 * rate)
        with self._lock:
            tokens, at = self._buckets.get(tenant, (burst, now))
            tokens = min(burst, tokens + (now - at) * rate)
            if tokens >= 1.0:
                self._buckets[tenant] = (tokens - 1.0, now)
                return 0.0
            self._buckets[tenant] = (tokens, now)
            return (1.0 - tokens) / rate if rate > 0 else 60.0
