"""One run of an operation for every caller that asks while it runs (a single flight).

A second caller does not start its own run and does not wait for a second one: it gets the run in
progress's result (or its error), within its own timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future


class SingleFlight:
    def __init__(self):
        self._lock = threading.Lock()
        self._running: Future | None = None

    def run(self, fn: Callable[[], object], timeout_s: float | None = None):
        with self._lock:
            fut, mine = self._running, self._running is None
            if mine:
                fut = self._running = Future()
        if mine:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - every caller of this run hears it
                fut.set_exception(e)
            finally:
                with self._lock:
                    self._running = None
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the run in progress had not ended after {timeout_s:g} s") from None
