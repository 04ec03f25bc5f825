"""The engine loop both model services share: one thread calls `run_once` until stopped."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from vlamux.model.device import dtype_name

log = logging.getLogger(__name__)


class EngineLoop:
    """Mixin: a model service defines `name`, `queue` (with close and metrics), `accounting`,
    `runner` and `run_once(timeout)`; this runs it on a daemon thread and reports liveness."""

    _thread: threading.Thread | None = None
    _running = False
    heartbeat = 0.0
    # "learned": measure the backbones' group caps at start and on request (vlamux.model.calibrate)
    group_cap: str | None = None
    group_budget_s: float | None = None
    _calibration: Future | None = None  # asked for and not finished: every caller meanwhile gets this one
    _calibration_steps = None  # its probe, in steps (runner.calibration), once begun
    _calibration_lock = threading.Lock()
    tiers = None  # a service that pages its slots (vlamux.services.slot_tiers.SlotTiers)

    def beat(self) -> None:
        """The engine made progress (the Health Manager's heartbeat): each loop, and each operation
        of a round that may outlast its bound."""
        self.heartbeat = time.monotonic()

    def _loop(self) -> None:
        self.runner.lane.claim_thread()  # a low lane (training) yields shared cores to a high one
        try:
            while self._running:
                self.beat()
                try:
                    if self._calibration is not None:  # one probe forward, then whatever is due
                        self._calibration_step()
                        self.run_once(0.0)
                    else:
                        self.run_once(0.05)
                except Exception:  # noqa: BLE001 - the engine must outlive one bad batch
                    log.exception("%s: engine iteration failed", self.name)
        finally:
            steps, self._calibration_steps = self._calibration_steps, None
            if steps is not None:
                steps.close()  # a probe cut short releases the process's probe lock

    def calibrate(self) -> Future:
        """Measure the group caps again, a probe forward at a time between groups; the future gets the
        curves. Asked again before that ends: the same calibration, the same future."""
        with self._calibration_lock:
            if self._calibration is None:
                self._calibration = Future()
            return self._calibration

    def _calibration_step(self) -> None:
        try:
            if self._calibration_steps is None:
                self._calibration_steps = self.runner.calibration(self.group_budget_s)
            next(self._calibration_steps)
            return
        except StopIteration as done:
            outcome = {bid: c.describe() for bid, c in done.value.items()}
        except Exception as e:  # noqa: BLE001 - serving goes on with the caps it had; the caller hears why
            log.exception("%s: group calibration failed", self.name)
            outcome = e
        with self._calibration_lock:
            fut, self._calibration, self._calibration_steps = self._calibration, None, None
        if fut is None:  # stopped meanwhile: stop() has answered its callers
            return
        fut.set_exception(outcome) if isinstance(outcome, Exception) else fut.set_result(outcome)

    def _calibrate(self, force: bool = True) -> None:
        """At start, before serving: measured at once (or the curve this process has, force=False)."""
        try:
            self.runner.calibrate(self.group_budget_s, force=force)
        except Exception:  # noqa: BLE001 - serving goes on uncapped
            log.exception("%s: group calibration failed", self.name)

    def start(self):
        if self.group_cap == "learned" and not self.runner.group_curves:
            self._calibrate(force=False)  # before serving: the first groups are capped already
        self._running = True
        self.beat()
        self._thread = threading.Thread(target=self._loop, name=f"vlamux-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, join_timeout_s: float = 10.0) -> None:
        """Stop the loop and fail what is still queued (callers may re-route it). A hung engine
        thread is not waited for beyond `join_timeout_s`: it is abandoned, and exits when it wakes."""
        self._running = False
        self.queue.close()
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout=join_timeout_s)
        with self._calibration_lock:
            fut, self._calibration = self._calibration, None
        if fut is not None and not fut.done():
            fut.set_exception(RuntimeError(f"{self.name} stopped before its calibration ended"))
        if self.tiers is not None:
            self.tiers.close()

    def alive(self) -> bool:
        """Running and not stopped: a stopped engine takes no work even while its thread winds down."""
        return self._running and self._thread is not None and self._thread.is_alive()

    def metrics(self) -> dict:
        lane = self.runner.lane
        return {"queue": self.queue.metrics(), "utilization": self.accounting.utilization(),
                "busy_s": self.accounting.busy_s, "tenants": len(self.runner.slots),
                "device": str(lane.device), "dtype": dtype_name(lane.dtype), "priority": lane.priority,
                "fuse_heads": self.runner.fuse_heads,
                "fused_calls": self.runner.fused.calls if self.runner.fused is not None else 0,
                "memory": self.runner.pools.stats(), "adapters": dict(self.runner.adapter_stats),
                "group_caps": {bid: c.describe() for bid, c in self.runner.group_curves.items()},
                "tenant_memory": {t: s.memory_bytes() for t, s in list(self.runner.slots.items())},
                **({"slots": self.tiers.metrics()} if self.tiers is not None else {})}
