"""A model service's slots in tiers: the mover under a `Pager`.

The runner holds the resident slots (its `slots` are those, and only those); this holds the parked
ones (`ParkedSlot`s in host memory) and the stored ones (slot files in a spool directory of its own,
scratch: never read after a restart, when jobs resume from their checkpoints), and applies the
pager's plan between two groups, on the engine thread, which alone changes the runner's slots.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
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
        self.moves = {"park": 0, "store": 0, "load": 0}

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
        if self._spool is not None:
            self._path(tenant).unlink(missing_ok=True)
        self.pager.remove(tenant)

    def page(self, waiting: list[str] = ()) -> PagePlan:
        """Apply the pager's plan now (`waiting`: tenants with requests queued): park, store, then load.
        Returns it (its `never`: tenants whose slot can never be resident, to be refused by the caller)."""
        plan = self.pager.plan(waiting)
        for t in plan.park:
            slot = self.runner.remove_slot(t)
            self.parked[t], self.versions[t] = park(slot), slot.version
            self.pager.moved(t, "parked", holds_gradients=slot.accumulated > 0)
            self.moves["park"] += 1
        for t in plan.store:
            store(self.parked.pop(t), self._path(t))
            self.pager.moved(t, "stored")
            self.moves["store"] += 1
        for t in plan.load:
            parked = self.parked.pop(t, None) or read_stored(self._path(t))
            backbone = self.runner.backbones[parked.backbone_id]
            slot = unpark(parked, backbone.meta, backbone.device, **self.runner.adapter_targets(parked.backbone_id))
            self.runner.add_slot(slot)
            self.versions.pop(t, None)
            self.pager.moved(t, "resident", nbytes=slot_nbytes(slot))
            self.moves["load"] += 1
        return plan

    def version(self, tenant: str) -> int | None:
        slot = self.runner.slots.get(tenant)
        return slot.version if slot is not None else self.versions.get(tenant)

    def metrics(self) -> dict:
        budget = self.pager.budget
        return {**self.pager.usage(), "moves": dict(self.moves),
                "budget": {"resident_bytes": budget.resident_bytes, "parked_bytes": budget.parked_bytes}}

    def close(self) -> None:
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)

    def _path(self, tenant: str) -> Path:
        if self._spool is None:
            self._spool = Path(tempfile.mkdtemp(prefix="vlamux-spool-"))
        # by a digest: a tenant's name is not a file name
        return self._spool / f"{hashlib.sha256(tenant.encode()).hexdigest()[:32]}.safetensors"
