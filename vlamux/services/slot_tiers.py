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
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from vlamux.model import ModelRunner
from vlamux.model.parking import ParkedSlot, park, read_stored, store, unpark
from vlamux.services.pager import PagePlan, Pager, SlotBudget

log = logging.getLogger(__name__)


def slot_nbytes(slot) -> int:
    return sum(slot.memory_bytes().values())


class SlotTiers:
    def __init__(self, runner: ModelRunner, budget: SlotBudget):
        self.runner = runner
        self.pager = Pager(budget)
        self.parked: dict[str, ParkedSlot] = {}
        self.versions: dict[str, int] = {}  # of the slots below resident
        self._spool: Path | None = None
        self.moves = {"park": 0, "store": 0, "load": 0, "read": 0}
        self._reading: dict[str, Future] = {}  # stored slots being read back
        self._loader: ThreadPoolExecutor | None = None

    def knows(self, tenant: str) -> bool:
        return tenant in self.pager.entries

    def resident(self, tenant: str) -> bool:
        return tenant in self.runner.slots

    def added(self, tenant: str) -> None:
        """A slot the runner made resident (a new tenant's)."""
        self.pager.add(tenant, slot_nbytes(self.runner.slots[tenant]))

    def retire(self, tenant: str) -> None:
        """The tenant is no longer served: its slot goes from whichever tier holds it."""
        if tenant in self.runner.slots:
            self.runner.remove_slot(tenant)
        self.parked.pop(tenant, None)
        self.versions.pop(tenant, None)
        reading = self._reading.pop(tenant, None)
        if reading is not None:
            reading.cancel()
        if self._spool is not None:
            self._path(tenant).unlink(missing_ok=True)
        self.pager.remove(tenant)

    def page(self, waiting: list[str] = ()) -> tuple[PagePlan, dict[str, Exception]]:
        """Apply the pager's plan now (`waiting`: tenants with requests queued): park, store, then load
        what is in host memory and start reading what is on disk. Returns the plan (its `never`: tenants
        whose slot can never be resident) and the tenants whose stored slot failed to read, with why: the
        caller answers their requests."""
        failed = self._read_back()
        plan = self.pager.plan(waiting)
        # Each move copies first and lets go of the old copy only once the new one exists: a move that
        # fails (no memory, a full disk) leaves the slot where it was, and the next round tries again.
        for t in plan.park:
            slot = self.runner.slots[t]
            self.parked[t], self.versions[t] = park(slot), slot.version
            self.runner.remove_slot(t)
            self.pager.moved(t, "parked", holds_gradients=slot.accumulated > 0)
            self.moves["park"] += 1
        for t in plan.store:
            try:
                store(self.parked[t], self._path(t))
            except OSError:  # a full disk: it stays parked, over the host budget; the loads below go on
                log.exception("storing tenant %r's slot failed; it stays in host memory", t)
                continue
            del self.parked[t]
            self.pager.moved(t, "stored")
            self.moves["store"] += 1
        for t in plan.load:
            parked = self.parked.get(t)
            if parked is None:  # on disk: read on the loader thread; resident on a later round
                if t not in self._reading:
                    self._reading[t] = self._reader().submit(read_stored, self._path(t))
                continue
            backbone = self.runner.backbones[parked.backbone_id]
            slot = unpark(parked, backbone.meta, backbone.device, **self.runner.adapter_targets(parked.backbone_id))
            self.runner.add_slot(slot)
            del self.parked[t]
            self.versions.pop(t, None)
            self.pager.moved(t, "resident", nbytes=slot_nbytes(slot))
            self.moves["load"] += 1
        return plan, failed

    def _read_back(self) -> dict[str, Exception]:
        """Stored slots read since the last round become parked."""
        failed = {}
        for t, reading in list(self._reading.items()):
            if not reading.done():
                continue
            del self._reading[t]
            try:
                self.parked[t] = reading.result()
            except Exception as e:  # noqa: BLE001 - that tenant's requests are answered with it
                # its only copy is unreadable: the slot is lost here (a new policy version brings it back)
                log.exception("reading tenant %r's stored slot back failed", t)
                failed[t] = e
                self.retire(t)
                continue
            self._path(t).unlink(missing_ok=True)  # parked now: the file was its only use
            self.pager.moved(t, "parked")
            self.moves["read"] += 1
        return failed

    def _reader(self) -> ThreadPoolExecutor:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="vlamux-slot-loader")
        return self._loader

    def version(self, tenant: str) -> int | None:
        slot = self.runner.slots.get(tenant)
        return slot.version if slot is not None else self.versions.get(tenant)

    def metrics(self) -> dict:
        budget = self.pager.budget
        return {**self.pager.usage(), "moves": dict(self.moves),
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
