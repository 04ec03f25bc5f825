"""The Health Manager: watches every role and restarts a failed one in place.

Each role reports liveness (its engine thread runs) and a heartbeat (its engine made progress
recently: a loop came round, or, within a long training round, one of its operations ended). A dead
or hung model service is replaced by a new one built on the same resident backbone; its tenants come back from their last published policy version (inference) or from
their last checkpoint, else their last published version (training). Environment workers are
pinged; dead or hung ones are replaced. Other roles and tenants are not touched.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)


@dataclass
class Role:
    name: str
    alive: Callable[[], bool]
    heartbeat: Callable[[], float]  # monotonic time of the last heartbeat
    restart: Callable[[], None]
    restarts: int = 0
    last_restart: float = field(default=0.0)


class HealthManager:
    def __init__(self, interval_s: float = 0.5, hung_after_s: float = 30.0,
                 env_check: Callable[[], dict] | None = None, env_check_every_s: float = 5.0):
        self.interval_s, self.hung_after_s = interval_s, hung_after_s
        self.roles: dict[str, Role] = {}
        self.env_check, self.env_check_every_s = env_check, env_check_every_s
        self.env_replacements = 0
        self.events: list[tuple[float, str, str]] = []  # (time, role, what happened)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, role: Role) -> None:
        with self._lock:
            self.roles[role.name] = role

    def unwatch(self, name: str) -> None:
        with self._lock:
            self.roles.pop(name, None)

    def check(self) -> list[str]:
        """One round: restart every role that is dead or hung; returns their names."""
        now = time.monotonic()
        with self._lock:
            roles = list(self.roles.values())
        restarted = []
        for role in roles:
            if not role.alive():
                why = "died"
            elif now - role.heartbeat() > self.hung_after_s:
                why = f"no heartbeat for {now - role.heartbeat():.1f}s"
            else:
                continue
            log.warning("health: role %s %s; restarting it", role.name, why)
            try:
                role.restart()
                role.restarts += 1
                role.last_restart = time.monotonic()
                self.events.append((time.time(), role.name, f"restarted: {why}"))
                restarted.append(role.name)
            except Exception as e:  # noqa: BLE001 - retried next round
                log.exception("health: restarting %s failed", role.name)
                self.events.append((time.time(), role.name, f"restart failed: {e}"))
        return restarted

    def _loop(self) -> None:
        last_env = time.monotonic()
        while not self._stop.wait(self.interval_s):
            self.check()
            if self.env_check is not None and time.monotonic() - last_env >= self.env_check_every_s:
                last_env = time.monotonic()
                try:
                    replaced = self.env_check()
                    self.env_replacements += sum(len(v) for v in replaced.values())
                    for sid, workers in replaced.items():
                        self.events.append((time.time(), f"env:{sid}", f"replaced workers {workers}"))
                except Exception:  # noqa: BLE001
                    log.exception("health: environment check failed")

    def start(self) -> HealthManager:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="vlamux-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
