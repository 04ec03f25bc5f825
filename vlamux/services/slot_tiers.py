"""A model service's slots in tiers: the mover under a `Pager`.

The runner holds the resident slots (its `slots` are those, and only those); this holds the parked
ones (`ParkedSlot`s in host memory) and the stored ones (slot files in a spool directory of its own,
scratch: never read after a restart, when jobs resume from their checkpoints), and applies the
pager's plan between two groups, on the engine thread, which alone changes the runner's slots. A
stored slot is read back (and verified) on a loader thread of its own, so the groups of resident
tenants go on meanwhile; once read it is parked, and a next round makes it resident.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from vlamux.model import ModelRunner, Slot
from vlamux.model.parking import ParkedSlot, park, read_stored, shell_key, store, unpark
from vlamux.model.slot_file import MODULE_PREFIXES
from vlamux.model.snapshot import PolicySnapshot
from vlamux.services.pager import PagePlan, Pager, SlotBudget
from vlamux.utils.stats import quantile

log = logging.getLogger(__name__)


SHELLS = 16


def slot_nbytes(slot) -> int:
    return sum(slot.memory_bytes().values())


class SlotTiers:
    """`on_read`: called (on the loader thread) when a stored slot has been read back, so that the
    engine's next round, which makes it resident, need not wait for a group to come due."""

    def __init__(self, runner: ModelRunner, budget: SlotBudget, on_read: Callable[[], None] | None = None):
        self.runner = runner
        self.pager = Pager(budget)
        self.on_read = on_read
        self.load_s: deque[float] = deque(maxlen=4096)  # a wanted slot's wait: its oldest request to resident
        self.page_s: deque[float] = deque(maxlen=4096)  # each paging round's time (the engine's, between groups)
        self.loads_by_tier = {"parked": 0, "stored": 0}  # where the slots made resident came from
        self.parked: dict[str, ParkedSlot] = {}
        self.versions: dict[str, int] = {}  # of the slots below resident
        self._spool: Path | None = None
        self.moves = {"park": 0, "store": 0, "load": 0, "read": 0}
        self._reading: dict[str, Future] = {}  # stored slots being read back
        self._reading_lock = threading.Lock()  # `prefetch` starts reads from request threads
        self._from_disk: set[str] = set()  # parked slots that were read back, not loaded yet
        # slot objects of serving slots just parked, by kind: a load of the same kind copies into one
        # instead of building a head's modules anew (SHELLS at most of each kind; their bytes are
        # counted in `metrics`, outside the budget)
        self._shells: dict[tuple, list[Slot]] = {}
        self._loader: ThreadPoolExecutor | None = None
        self._loader_lock = threading.Lock()

    def knows(self, tenant: str) -> bool:
        return tenant in self.pager.entries

    def resident(self, tenant: str) -> bool:
        return tenant in self.runner.slots

    def added(self, tenant: str) -> None:
        """A slot the runner made resident (a new tenant's)."""
        self.pager.add(tenant, slot_nbytes(self.runner.slots[tenant]))

    def room_for(self, snap: PolicySnapshot) -> bool:
        """Whether a new tenant's slot fits the resident budget beside the slots already there."""
        limit = self.pager.budget.resident_bytes
        module = sum(t.numel() * t.element_size() for k, t in snap.tensors.items() if k.startswith(MODULE_PREFIXES))
        return limit is None or self.pager.used["resident"] + module <= limit

    def admit_parked(self, snap: PolicySnapshot) -> None:
        """A new tenant, straight to host memory (the resident tier is full: it comes up when asked)."""
        backbone = self.runner.backbones[snap.backbone_id]
        slot = Slot(snap.tenant, snap.head_spec, backbone.meta, device="cpu", init=False, trainable=False,
                    **self.runner.adapter_targets(snap.backbone_id))
        slot.apply_policy(snap.ready())
        # its parked bytes are the resident slot's: what the pager plans with in every tier
        self.parked[snap.tenant], self.versions[snap.tenant] = park(slot), snap.version
        self.pager.add(snap.tenant, slot_nbytes(slot), tier="parked")

    def retire(self, tenant: str) -> None:
        """The tenant is no longer served: its slot goes from whichever tier holds it."""
        if tenant in self.runner.slots:
            self.runner.remove_slot(tenant)
        self.parked.pop(tenant, None)
        self.versions.pop(tenant, None)
        self._from_disk.discard(tenant)
        with self._reading_lock:
            reading = self._reading.pop(tenant, None)
        if reading is not None:
            reading.cancel()
        if self._spool is not None:
            self._path(tenant).unlink(missing_ok=True)
        self.pager.remove(tenant)

    def page(self, waiting: dict[str, float] | None = None) -> tuple[PagePlan, dict[str, Exception]]:
        """Apply the pager's plan now (`waiting`: tenants with requests queued -> when the oldest came,
        time.monotonic(), the oldest first): park, store, then load what is in host memory and start
        reading what is on disk. Returns the plan (its `never`: tenants whose slot can never be resident)
        and the tenants whose stored slot failed to read, with why: the caller answers their requests."""
        t0 = time.monotonic()
        try:
            return self._page(waiting or {})
        finally:
            self.page_s.append(time.monotonic() - t0)

    def _page(self, waiting: dict[str, float]) -> tuple[PagePlan, dict[str, Exception]]:
        failed = self._read_back()
        plan = self.pager.plan(list(waiting))
        # Each move copies first and lets go of the old copy only once the new one exists: a move that
        # fails (no memory, a full disk) leaves the slot where it was, and the next round tries again.
        for t in plan.park:
            slot = self.runner.slots[t]
            self.parked[t], self.versions[t] = park(slot), slot.version
            self.runner.remove_slot(t)
            self.pager.moved(t, "parked", holds_gradients=slot.accumulated > 0)
            self.moves["park"] += 1
            self._keep_shell(slot)
        for t in plan.store:
            try:
                store(self.parked[t], self._path(t), durable=False)  # scratch: a restart never reads it
            except OSError:  # a full disk: it stays parked, over the host budget; the loads below go on
                log.exception("storing tenant %r's slot failed; it stays in host memory", t)
                continue
            del self.parked[t]
            self.pager.moved(t, "stored")
            self.moves["store"] += 1
        for t in plan.load:
            parked = self.parked.get(t)
            if parked is None:  # on disk: read on the loader thread; resident on a later round
                self._start_read(t)
                continue
            self.loads_by_tier["stored" if t in self._from_disk else "parked"] += 1
            self._from_disk.discard(t)
            if t in waiting:
                self.load_s.append(time.monotonic() - waiting[t])
            backbone = self.runner.backbones[parked.backbone_id]
            slot = unpark(parked, backbone.meta, backbone.device, shell=self._shell(parked),
                          **self.runner.adapter_targets(parked.backbone_id))
            self.runner.add_slot(slot)
            del self.parked[t]
            self.versions.pop(t, None)
            self.pager.moved(t, "resident", nbytes=slot_nbytes(slot))
            self.moves["load"] += 1
        return plan, failed

    def _keep_shell(self, slot: Slot) -> None:
        if slot.optimizer is not None:  # a training slot's optimizer is the tenant's: not reused
            return
        shells = self._shells.setdefault(shell_key(slot.head_spec.to_json(), slot.backbone_id, False), [])
        if len(shells) < SHELLS:
            shells.append(slot)

    def _shell(self, parked: ParkedSlot) -> Slot | None:
        if parked.meta.get("optimizer") != "none":
            return None
        shells = self._shells.get(shell_key(parked.meta["head_spec"], parked.backbone_id, False))
        return shells.pop() if shells else None

    def _read_back(self) -> dict[str, Exception]:
        """Stored slots read since the last round become parked."""
        failed = {}
        with self._reading_lock:
            done = {t: r for t, r in self._reading.items() if r.done()}
            for t in done:
                del self._reading[t]
        for t, reading in done.items():
            if self.pager.entries.get(t) is None or self.pager.entries[t].tier != "stored":
                continue  # retired meanwhile
            try:
                self.parked[t] = reading.result()
            except Exception as e:  # noqa: BLE001 - that tenant's requests are answered with it
                # its only copy is unreadable: the slot is lost here (a new policy version brings it back)
                log.exception("reading tenant %r's stored slot back failed", t)
                failed[t] = e
                self.retire(t)
                continue
            self._path(t).unlink(missing_ok=True)  # parked now: the file was its only use
            self._from_disk.add(t)
            self.pager.moved(t, "parked")
            self.moves["read"] += 1
        return failed

    def prefetch(self, tenant: str) -> None:
        """A request for `tenant` came: if its slot is on disk, start reading it now (any thread), so it is
        in host memory by the round after the group that runs meanwhile."""
        e = self.pager.entries.get(tenant)
        if e is not None and e.tier == "stored":
            self._start_read(tenant)

    def _start_read(self, tenant: str) -> None:
        with self._reading_lock:
            if tenant not in self._reading:
                self._reading[tenant] = self._reader().submit(self._read, tenant)

    def _read(self, tenant: str) -> ParkedSlot:
        try:
            return read_stored(self._path(tenant))
        finally:
            if self.on_read is not None:
                self.on_read()

    def _reader(self) -> ThreadPoolExecutor:
        with self._loader_lock:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="vlamux-slot-loader")
            return self._loader

    def version(self, tenant: str) -> int | None:
        slot = self.runner.slots.get(tenant)
        return slot.version if slot is not None else self.versions.get(tenant)

    def metrics(self) -> dict:
        budget = self.pager.budget
        shells = [s for kind in self._shells.values() for s in kind]
        return {**self.pager.usage(), "moves": dict(self.moves), "loads_from": dict(self.loads_by_tier),
                "shells": {"count": len(shells), "bytes": sum(slot_nbytes(s) for s in shells)},
                "load_wait_s": {"p50": quantile(self.load_s, 0.5), "p99": quantile(self.load_s, 0.99),
                                "n": len(self.load_s)},
                "budget": {"resident_bytes": budget.resident_bytes, "parked_bytes": budget.parked_bytes}}

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)

    def _path(self, tenant: str) -> Path:
        if self._spool is None:
            self._spool = Path(tempfile.mkdtemp(prefix="vlamux-spool-"))
        # by a digest: a tenant's name is not a file name
        return self._spool / f"{hashlib.sha256(tenant.encode()).hexdigest()[:32]}.safetensors"
