"""Which tenants' slots are resident, parked or stored: the pager decides, the service moves.

A model service keeps the slots recent groups used resident (on its device), up to a byte budget, and
the rest lower: parked (host memory) up to a second budget, stored (a slot file) beyond it. When a
request needs a slot that is not resident, the least recently used resident slots that no group is
using make room; a slot that cannot be made resident now (everything else in use) waits, and one
larger than the whole budget can never be. A slot holding gradients not yet stepped is never stored
(a slot file has none). This module only decides (`plan_pages` is a pure function, `Pager` its
bookkeeping); `vlamux.model.parking` moves the tensors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

TIERS = ("resident", "parked", "stored")


AUTO_FRACTION = 0.25  # of a GPU's free memory when its replica starts: the resident budget "auto"


@dataclass(frozen=True)
class SlotBudget:
    resident_bytes: int | str | None = None  # None: no limit; "auto": see `placed`
    parked_bytes: int | None = None

    def placed(self, device) -> SlotBudget | None:
        """The budget a replica on `device` keeps. "auto": on a GPU, AUTO_FRACTION of the memory free
        now (the backbones loaded; the training service's share left); on a CPU, none (its slots are in
        host memory already: with no host budget either, every slot stays resident)."""
        if self.resident_bytes != "auto":
            return self
        import torch

        device = torch.device(device)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return SlotBudget(int(free * AUTO_FRACTION), self.parked_bytes)
        return None if self.parked_bytes is None else SlotBudget(None, self.parked_bytes)


@dataclass
class SlotEntry:
    tenant: str
    tier: str
    nbytes: int  # what the slot costs in its tier (parameters, and optimizer state where it trains)
    last_used: int = 0  # the pager's group count when a group last used it
    pinned: int = 0  # groups using it now: it stays resident until they finish
    holds_gradients: bool = False


@dataclass(frozen=True)
class PagePlan:
    load: list[str] = field(default_factory=list)  # to resident, in this order
    park: list[str] = field(default_factory=list)  # resident -> parked
    store: list[str] = field(default_factory=list)  # parked (or just parked) -> stored
    waiting: list[str] = field(default_factory=list)  # wanted, not resident yet: room is in use
    never: list[str] = field(default_factory=list)  # wanted, larger than the whole resident budget

    @property
    def moves(self) -> bool:
        return bool(self.load or self.park or self.store)


def plan_pages(entries: dict[str, SlotEntry], wanted: list[str], budget: SlotBudget,
               by_tier: dict[str, dict[str, SlotEntry]] | None = None, used: dict[str, int] | None = None) -> PagePlan:
    """The moves that make `wanted` (oldest request first) resident within `budget`, and keep the parked
    tier within its own, evicting least recently used first. Unknown tenants in `wanted` are ignored.
    by_tier, used: the same entries by tier and each tier's bytes (a `Pager` keeps them), so that a plan
    costs what is resident, wanted and over the parked budget, not every tenant the service knows."""
    plan = PagePlan()
    if by_tier is None:
        by_tier = {name: {t: e for t, e in entries.items() if e.tier == name} for name in TIERS}
    moved: dict[str, str] = {}  # this plan's moves: tenant -> its tier once they are made
    used = dict(used) if used is not None else {name: sum(e.nbytes for e in by_tier[name].values()) for name in TIERS}
    wanted = [t for t in dict.fromkeys(wanted) if t in entries]
    keep = set(wanted)
    older: set[str] = set()  # wanted tenants whose requests are older than the one being placed

    def tier_of(t: str) -> str:
        return moved.get(t) or entries[t].tier

    def lru(name: str, ok) -> list[SlotEntry]:
        members = {**by_tier[name], **{t: entries[t] for t, to in moved.items() if to == name}}
        return sorted((e for t, e in members.items() if tier_of(t) == name and ok(e)), key=lambda e: e.last_used)

    def evictable(e: SlotEntry) -> bool:
        return not e.pinned and e.tenant not in keep

    def evictable_for_older(e: SlotEntry) -> bool:  # a newer request's slot gives way to an older one's
        return not e.pinned and e.tenant not in older

    def park(e: SlotEntry) -> None:
        moved[e.tenant] = "parked"
        used["resident"] -= e.nbytes
        used["parked"] += e.nbytes
        plan.park.append(e.tenant)

    limit = budget.resident_bytes
    # sorted once: a tenant this plan loads is wanted (never a victim), one it parks is skipped
    resident_lru = sorted(by_tier["resident"].values(), key=lambda e: e.last_used)
    for t in wanted:
        older.add(t)
        e = entries[t]
        if limit is not None and e.nbytes > limit:  # made resident when it came (a new tenant): not to stay
            plan.never.append(t)
            if tier_of(t) == "resident" and not e.pinned:
                park(e)
            continue
        if tier_of(t) == "resident":
            continue
        if limit is not None:  # the least recently used first, and none unless that makes room
            room, victims = limit - used["resident"], {}
            # first slots nobody waits for; only then those of newer requests (a tenant waiting in a
            # busy queue is the least recently used: taking its slot first would page it out and back)
            for ok in (evictable, evictable_for_older):
                for v in resident_lru:
                    if room >= e.nbytes:
                        break
                    if tier_of(v.tenant) != "resident" or not ok(v) or v.tenant in victims:
                        continue
                    victims[v.tenant] = v
                    room += v.nbytes
            if room < e.nbytes:
                plan.waiting.append(t)
                continue
            for v in victims.values():
                park(v)
        if tier_of(t) == "parked":
            used["parked"] -= e.nbytes
        used["resident"] += e.nbytes
        moved[t] = "resident"
        plan.load.append(t)
    if limit is not None:  # a budget lowered, or slots grown (optimizer state after a first step)
        for e in lru("resident", evictable):
            if used["resident"] <= limit:
                break
            park(e)
    if budget.parked_bytes is not None:
        for e in lru("parked", lambda e: not e.holds_gradients and e.tenant not in keep):
            if used["parked"] <= budget.parked_bytes:
                break
            moved[e.tenant] = "stored"
            used["parked"] -= e.nbytes
            plan.store.append(e.tenant)
    return plan


class Pager:
    """A service's slot directory by tier, with the group count that orders use. Which slots are wanted
    is not kept here: it is the tenants whose requests wait in the service's queue (`plan(waiting)`).
    Thread-safe: metrics read it while the engine `pin`s, `unpin`s and applies moves."""

    def __init__(self, budget: SlotBudget | None = None):
        self.budget = budget or SlotBudget()
        self.entries: dict[str, SlotEntry] = {}
        self.by_tier: dict[str, dict[str, SlotEntry]] = {name: {} for name in TIERS}
        self.used = dict.fromkeys(TIERS, 0)  # bytes per tier
        self.groups = 0
        self._lock = threading.Lock()

    def add(self, tenant: str, nbytes: int, tier: str = "resident") -> None:
        if tier not in TIERS:
            raise ValueError(f"slot tier: one of {TIERS}, got {tier!r}")
        with self._lock:
            old = self.entries.get(tenant)  # replaced (a tenant served afresh): groups using it still do
            if old is not None:
                del self.by_tier[old.tier][tenant]
                self.used[old.tier] -= old.nbytes
            self.used[tier] += nbytes
            self.entries[tenant] = self.by_tier[tier][tenant] = SlotEntry(tenant, tier, nbytes, self.groups,
                                                                        old.pinned if old else 0)

    def remove(self, tenant: str) -> None:
        with self._lock:
            e = self.entries.pop(tenant, None)
            if e is not None:
                del self.by_tier[e.tier][tenant]
                self.used[e.tier] -= e.nbytes

    def resident(self, tenant: str) -> bool:
        e = self.entries.get(tenant)
        return e is not None and e.tier == "resident"

    def pin(self, tenants) -> None:
        with self._lock:
            self.groups += 1
            for t in tenants:
                e = self.entries[t]
                if e.tier != "resident":
                    raise RuntimeError(f"tenant {t!r}: its slot is {e.tier}, not resident; a group cannot use it")
                e.pinned += 1
                e.last_used = self.groups

    def unpin(self, tenants) -> None:
        with self._lock:
            for t in tenants:
                if t in self.entries:
                    self.entries[t].pinned = max(0, self.entries[t].pinned - 1)

    def plan(self, waiting: list[str] = ()) -> PagePlan:
        """The moves to make now; `waiting`: tenants with requests queued, the oldest request's first."""
        with self._lock:
            return plan_pages(self.entries, list(waiting), self.budget, self.by_tier, self.used)

    def moved(self, tenant: str, tier: str, nbytes: int | None = None, holds_gradients: bool | None = None) -> None:
        """A move of the plan is done (the slot is in `tier` now)."""
        with self._lock:
            e = self.entries[tenant]
            del self.by_tier[e.tier][tenant]
            self.used[e.tier] -= e.nbytes
            e.tier = tier
            self.by_tier[tier][tenant] = e
            if nbytes is not None:
                e.nbytes = nbytes
            self.used[tier] += e.nbytes
            if holds_gradients is not None:
                e.holds_gradients = holds_gradients

    def usage(self) -> dict[str, dict[str, int]]:
        """Count and bytes per tier, for metrics."""
        with self._lock:
            return {name: {"count": len(members), "bytes": self.used[name]} for name, members in self.by_tier.items()}
