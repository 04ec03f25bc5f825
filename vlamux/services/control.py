"""The control plane: tenant policy versions travel from the Training Model Service to every
Inference Model Service replica, on their own thread and queue, never with the data plane.

Only a tenant's module (head weights and statistics) travels, never the backbone. Versions of the
same tenant waiting to be delivered are coalesced: a replica only ever needs the newest. A tenant
whose slot is gone is `Retired` the same way, in order with its versions: the replicas free its
serving slot.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from vlamux.model.snapshot import PolicySnapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retired:
    """A tenant's policy is no longer served: what a replica gets in place of a version."""

    tenant: str

    def nbytes(self) -> int:
        return 0


class PolicyPublisher:
    def __init__(self):
        self.busy_s = 0.0
        self._subscribers: dict[str, Callable[[PolicySnapshot], None]] = {}
        self._pending: dict[str, PolicySnapshot | Retired] = {}  # tenant -> newest undelivered snapshot
        self._after_retired: dict[str, PolicySnapshot] = {}  # a version published after a pending retirement
        self._cv = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._delivering = False
        self.delivered = 0
        self.bytes_sent = 0

    def subscribe(self, name: str, deliver: Callable[[PolicySnapshot | Retired], None]) -> None:
        with self._cv:
            self._subscribers[name] = deliver

    def unsubscribe(self, name: str) -> None:
        with self._cv:
            self._subscribers.pop(name, None)

    def publish(self, snap: PolicySnapshot) -> None:
        with self._cv:
            old = self._pending.get(snap.tenant)
            if isinstance(old, Retired):  # served again after its retirement: delivered after it, in order
                after = self._after_retired.get(snap.tenant)
                if after is None or after.version <= snap.version:
                    self._after_retired[snap.tenant] = snap
            elif old is None or old.version <= snap.version:
                self._pending[snap.tenant] = snap
            self._cv.notify_all()

    def retire(self, tenant: str) -> None:
        """Every subscriber frees the tenant's serving slot (a version of it still waiting goes unsent)."""
        with self._cv:
            self._pending[tenant] = Retired(tenant)
            self._after_retired.pop(tenant, None)
            self._cv.notify_all()

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="vlamux-control-plane", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._running = False
            self._cv.notify_all()
        if self._thread:
            self._thread.join(timeout=5)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every published snapshot has been delivered; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and not self._after_retired and not self._delivering,
                                     timeout)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending or not self._running)
                if not self._running and not self._pending:
                    return
                batch = [*self._pending.values(), *self._after_retired.values()]  # retirements first
                self._pending, self._after_retired = {}, {}
                self._delivering = True
                subscribers = list(self._subscribers.items())
            t0 = time.perf_counter()
            for snap in batch:
                for name, deliver in subscribers:
                    try:
                        deliver(snap)
                        self.delivered += 1
                        self.bytes_sent += snap.nbytes()
                    except Exception:  # noqa: BLE001 - one replica's failure must not stop the others
                        log.exception("delivering tenant %r's %s to %s failed", snap.tenant,
                                      f"version {snap.version}" if hasattr(snap, "version") else "retirement", name)
            with self._cv:
                self.busy_s += time.perf_counter() - t0  # the distribution lane's busy time
                self._delivering = False
                self._cv.notify_all()
