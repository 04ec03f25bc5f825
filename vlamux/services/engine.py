"""The engine loop both model services share: one thread calls `run_once` until stopped."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


class EngineLoop:
    """Mixin: a model service defines `name`, `queue` (with close and metrics), `accounting`,
    `runner` and `run_once(timeout)`; this runs it on a daemon thread and reports liveness."""

    _thread: threading.Thread | None = None
    _running = False
    heartbeat = 0.0

    def _loop(self) -> None:
        while self._running:
            self.heartbeat = time.monotonic()
            try:
                self.run_once(0.05)
            except Exception:  # noqa: BLE001 - the engine must outlive one bad batch
                log.exception("%s: engine iteration failed", self.name)

    def start(self):
        self._running = True
        self.heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name=f"vlamux-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._running = False
        self.queue.close()
        if self._thread:
            self._thread.join(timeout=10)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def metrics(self) -> dict:
        return {"queue": self.queue.metrics(), "utilization": self.accounting.utilization(),
                "tenants": len(self.runner.slots)}
