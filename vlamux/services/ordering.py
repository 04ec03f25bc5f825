"""Futures chained without waiting: a tenant's calls sent one after another (`TenantOrder`), and a
result mapped on the thread that completes it (`then`). For transports whose calls complete on
threads of their own (Ray's), where nothing may block."""

from __future__ import annotations

import threading
from concurrent.futures import Future


class TenantOrder:
    """`order(tenant, send)`: `send()` (a future of a call) once the tenant's previous call finished,
    whether it failed or not; the returned future carries the call's outcome."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last: dict[str, Future] = {}  # each tenant's newest call

    def __call__(self, tenant: str, send) -> Future:
        out: Future = Future()
        with self._lock:
            prev, self._last[tenant] = self._last.get(tenant), out

        def go(_=None) -> None:
            try:
                inner = send()
            except Exception as e:  # noqa: BLE001 - the caller's future carries it
                out.set_exception(e)
                return
            inner.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() is not None
                                    else out.set_result(f.result()))

        def forget(_) -> None:  # a tenant with no call in flight holds no place
            with self._lock:
                if self._last.get(tenant) is out:
                    del self._last[tenant]

        out.add_done_callback(forget)
        if prev is None:
            go()
        else:
            prev.add_done_callback(go)
        return out


def then(fut: Future, fn) -> Future:
    """A future of `fn(fut's result)`, computed on the thread that completes `fut` (Ray's: `fn` must not
    wait on Ray)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 - the caller's future carries it
            out.set_exception(e)

    fut.add_done_callback(done)
    return out
