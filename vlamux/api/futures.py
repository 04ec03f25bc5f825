"""Futures the API hands out: a training call's result, read later by id (`GET /v1/futures/{id}`).

Each is its tenant's: another tenant's id answers 404, as a missing one does. A finished future is
kept `ttl_s` for its result to be read, then dropped; a tenant's long polls are capped.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field

from vlamux.api.faults import NotFound, QuotaExceeded

FUTURE_TTL_S = 600.0  # a finished future's result is kept this long for the client to read


@dataclass
class TrackedFuture:
    id: str
    tenant_id: str
    op: str
    future: Future
    created: float = field(default_factory=time.time)
    done_at: float | None = None

    def view(self) -> dict:
        out = {"id": self.id, "op": self.op, "state": "pending", "result": None, "error": None}
        if self.future.done():
            e = self.future.exception()
            if e is None:
                out["state"], out["result"] = "done", jsonable(self.future.result())
            else:
                out["state"], out["error"] = "failed", {"type": type(e).__name__, "message": str(e)}
        return out


class Futures:
    def __init__(self, max_waits_per_tenant: int, ttl_s: float = FUTURE_TTL_S):
        self.max_waits, self.ttl_s = max_waits_per_tenant, ttl_s
        self._lock = threading.Lock()
        self._futures: dict[str, TrackedFuture] = {}
        self._waits: dict[str, int] = {}

    def track(self, tenant_id: str, op: str, fut: Future) -> dict:
        """Hand out `fut` under a new id; its view."""
        f = TrackedFuture(uuid.uuid4().hex[:16], tenant_id, op, fut)
        fut.add_done_callback(lambda _: setattr(f, "done_at", time.time()))
        self.sweep()
        with self._lock:
            self._futures[f.id] = f
        return f.view()

    def sweep(self) -> None:
        """Drop the futures finished more than `ttl_s` ago."""
        now = time.time()
        with self._lock:
            for fid in [k for k, g in self._futures.items() if g.done_at and now - g.done_at > self.ttl_s]:
                del self._futures[fid]

    def get(self, tenant_id: str, future_id: str) -> TrackedFuture:
        """The tenant's future `future_id` (404 for another tenant's, as for a missing one)."""
        with self._lock:
            f = self._futures.get(future_id)
        if f is None or f.tenant_id != tenant_id:
            raise NotFound(f"no future {future_id!r}")
        return f

    @contextlib.contextmanager
    def long_poll(self, tenant_id: str):
        """One of the tenant's waiting requests, counted: past `max_waits` at once, 429."""
        with self._lock:
            n = self._waits.get(tenant_id, 0)
            if n >= self.max_waits:
                raise QuotaExceeded(f"rate limited: {n} requests of this tenant are already waiting (at most "
                                    f"{self.max_waits} long polls at once)", retry_after_s=1.0)
            self._waits[tenant_id] = n + 1
        try:
            yield
        finally:
            with self._lock:
                self._waits[tenant_id] -= 1


def jsonable(x):
    """A call's result as JSON: tensors and arrays as numbers or lists, dataclasses as maps."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "__dataclass_fields__"):
        return jsonable(asdict(x))
    return str(x)
