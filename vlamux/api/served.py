"""Finished jobs' policies, served from their checkpoints while tenants ask for them.

A job's slot is freed when the job ends: its trained policy lives on in its checkpoints, and no
training slot holds it. A predict on it puts that policy version on the inference replicas (a serving
slot: module and statistics, no optimizer) and keeps it there while it is used: at most
`per_tenant` such policies of one tenant at once (the least recently used goes first), each retired
after `idle_s` without a predict. What is served is the job's newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from vlamux.api.faults import NotFound

if TYPE_CHECKING:  # the contract, for annotations only
    from vlamux.services.contract import Runtime

log = logging.getLogger(__name__)


class ServedPolicies:
    def __init__(self, runtime: Runtime, per_tenant: int = 4, idle_s: float = 600.0, load_timeout_s: float = 120.0):
        self.runtime, self.per_tenant, self.idle_s = runtime, per_tenant, idle_s
        self.load_timeout_s = load_timeout_s
        self._last_use: OrderedDict[str, float] = OrderedDict()  # slot key -> last predict, oldest first
        self._loading: dict[str, Future] = {}  # slot key -> its load in progress (one for all who ask)
        self._lock = threading.Lock()  # held for the maps only: files and the runtime are read outside it

    def ensure(self, key: str, tenant_id: str, checkpoints: list, verify) -> None:
        """The policy of slot `key` is on the replicas: already, or now from the newest of `checkpoints`
        (the store's records, newest first; `verify` checks a record's file before it is read)."""
        while True:
            with self._lock:
                if key in self._last_use:
                    self._last_use[key] = time.monotonic()
                    self._last_use.move_to_end(key)
                    return
                busy = self._loading.get(key)
                if busy is None:
                    mine = self._loading[key] = Future()
                    break
            # this policy is being loaded (then it is served) or retired (then it is loaded again)
            busy.result(self.load_timeout_s)
        try:
            self._load(key, tenant_id, checkpoints, verify)
            mine.set_result(None)
        except BaseException as e:
            mine.set_exception(e)
            raise
        finally:
            with self._lock:
                self._loading.pop(key, None)

    def _load(self, key: str, tenant_id: str, checkpoints: list, verify) -> None:
        from vlamux.policy import snapshot_of

        if not checkpoints:
            raise NotFound("this job ended without a checkpoint: it has no trained policy to serve")
        verify(checkpoints[0])
        snap = dataclasses.replace(snapshot_of(Path(checkpoints[0].path)), tenant=key)
        with self._lock:  # room for it among the tenant's own: its least recently used go
            mine = [k for k in self._last_use if k.startswith(f"{tenant_id}/")]
            evicted = self._take(mine[:max(0, len(mine) - self.per_tenant + 1)])
        self._retire(evicted)
        self.runtime.serve(snap)
        with self._lock:
            self._last_use[key] = time.monotonic()

    def sweep(self) -> int:
        """Retire what nobody asked for in `idle_s`; how many."""
        now = time.monotonic()
        with self._lock:
            idle = self._take([k for k, t in self._last_use.items() if now - t > self.idle_s])
        self._retire(idle)
        return len(idle)

    def serving(self) -> list[str]:
        with self._lock:
            return list(self._last_use)

    def _take(self, keys: list[str]) -> dict[str, Future]:
        """(Under the lock) these keys leave the served ones; a request for one meanwhile waits for its
        retirement, then loads it again (so a retirement never lands after a new load)."""
        out = {}
        for key in keys:
            self._last_use.pop(key, None)
            out[key] = self._loading[key] = Future()
        return out

    def _retire(self, keys: dict[str, Future]) -> None:
        for key, done in keys.items():
            try:
                self.runtime.retire(key)
            except Exception:  # noqa: BLE001 - a replica that missed it drops the slot at its next restart
                log.exception("retiring the served policy %s", key)
            finally:
                with self._lock:
                    self._loading.pop(key, None)
                done.set_result(None)
