"""The pager's decisions (vlamux/services/pager.py): least recently used first, never a slot a group
is using or a request is waiting for, waiting rather than failing, and no slot holding gradients stored."""

import random

import pytest

from vlamux.services.pager import Pager, SlotBudget, SlotEntry, plan_pages


def entries(**tiers) -> dict[str, SlotEntry]:
    """name=(tier, last_used[, pinned[, holds_gradients]]), each slot 10 bytes."""
    out = {}
    for name, (tier, last, *rest) in tiers.items():
        out[name] = SlotEntry(name, tier, 10, last, *(rest[:1] or [0]), *(rest[1:2] or [False]))
    return out


def test_a_wanted_slot_evicts_the_least_recently_used():
    e = entries(a=("resident", 1), b=("resident", 3), c=("resident", 2), d=("parked", 0), s=("stored", 0))
    plan = plan_pages(e, ["d", "s"], SlotBudget(resident_bytes=30))
    assert plan.park == ["a", "c"] and plan.load == ["d", "s"] and not plan.waiting


def test_slots_in_use_or_wanted_stay_and_a_request_waits_rather_than_fails():
    e = entries(a=("resident", 1, 1), b=("resident", 2), d=("parked", 0), x=("parked", 0))
    plan = plan_pages(e, ["d", "x"], SlotBudget(resident_bytes=20))
    assert plan.park == ["b"] and plan.load == ["d"] and plan.waiting == ["x"]  # a pinned; d, once loaded, stays
    all_busy = entries(a=("resident", 1, 1), b=("resident", 2, 1), d=("parked", 0))
    plan = plan_pages(all_busy, ["d"], SlotBudget(resident_bytes=20))
    assert plan.waiting == ["d"] and not plan.park  # nothing evicted for nothing


def test_an_older_request_is_not_starved_by_resident_tenants_with_newer_ones():
    """C's request is the oldest: the resident A and B, with requests queued after it, give way (the
    least recently used first); a pinned slot never does."""
    e = entries(a=("resident", 2), b=("resident", 1), c=("parked", 0))
    plan = plan_pages(e, ["c", "a", "b"], SlotBudget(resident_bytes=20))
    assert plan.park == ["b"] and plan.load == ["c"] and plan.waiting == ["b"]  # b now waits its turn
    e["b"].pinned = 1
    assert plan_pages(e, ["c", "a", "b"], SlotBudget(resident_bytes=20)).park == ["a"]


def test_a_slot_nobody_waits_for_goes_before_one_a_newer_request_waits_for():
    """A waits in a busy queue (so it is the least recently used); B has no request: C's older
    request takes B's room, not A's, which would only be paged out and back in."""
    e = entries(a=("resident", 1), b=("resident", 5), c=("parked", 0))
    plan = plan_pages(e, ["c", "a"], SlotBudget(resident_bytes=20))
    assert plan.park == ["b"] and plan.load == ["c"] and not plan.waiting


def test_a_slot_larger_than_the_budget_is_never_resident():
    e = entries(a=("resident", 1))
    e["big"] = SlotEntry("big", "stored", 100)
    plan = plan_pages(e, ["big"], SlotBudget(resident_bytes=50))
    assert plan.never == ["big"] and not plan.park and not plan.load


def test_the_parked_tier_keeps_its_budget_and_never_stores_gradients():
    e = entries(a=("resident", 5), p1=("parked", 1, 0, True), p2=("parked", 2), p3=("parked", 3), w=("parked", 0))
    plan = plan_pages(e, ["w"], SlotBudget(resident_bytes=10, parked_bytes=20))
    # a parked to make room for w; then parked = p1, p2, p3, a: 40 > 20, so the two oldest storable go
    assert plan.park == ["a"] and plan.load == ["w"] and plan.store == ["p2", "p3"]


def test_random_plans_keep_every_rule():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(1, 12)
        e = {f"t{i}": SlotEntry(f"t{i}", rng.choice(["resident", "parked", "stored"]), rng.randint(1, 30),
                                rng.randint(0, 20), rng.random() < 0.2, rng.random() < 0.2) for i in range(n)}
        for x in e.values():  # a pinned slot is resident, a stored one holds no gradients
            x.pinned = x.pinned if x.tier == "resident" else 0
            x.holds_gradients = x.holds_gradients and x.tier != "stored"
        wanted = rng.sample(list(e), rng.randint(0, n))
        budget = SlotBudget(rng.randint(10, 120), rng.choice([None, rng.randint(0, 100)]))
        plan = plan_pages(e, wanted, budget)
        tier = {t: x.tier for t, x in e.items()}
        for t in plan.park:
            assert tier[t] == "resident" and not e[t].pinned  # a newer request's slot may give way to an older one
            tier[t] = "parked"
        for t in plan.load:
            assert t in wanted and tier[t] != "resident"
            tier[t] = "resident"
        for t in plan.store:
            assert tier[t] == "parked" and not e[t].holds_gradients and t not in wanted
            tier[t] = "stored"
        if plan.load:
            assert sum(e[t].nbytes for t in tier if tier[t] == "resident") <= budget.resident_bytes
        placed = set(plan.load) | set(plan.waiting) | set(plan.never)
        assert {t for t in wanted if e[t].tier != "resident"} <= placed <= set(wanted)
        assert all(e[t].nbytes > budget.resident_bytes for t in plan.never)


def test_fifty_tenants_taking_turns_with_room_for_ten():
    """Each turn a tenant asks; the pager's moves are applied; the tenant's group runs. Every request is
    served, at most ten slots are ever resident, and a slot a group uses is never moved."""
    pager = Pager(SlotBudget(resident_bytes=100))
    for i in range(50):
        pager.add(f"t{i}", 10, "stored")
    rng, served, in_group = random.Random(1), 0, set()
    for turn in range(500):
        t = f"t{rng.randrange(50)}" if turn % 3 else f"t{turn % 50}"
        if not pager.resident(t):
            plan = pager.plan([t])
            assert not (set(plan.park) | set(plan.store)) & in_group
            for name in plan.park:
                pager.moved(name, "parked")
            for name in plan.load:
                pager.moved(name, "resident")
            assert t in plan.load
        pager.pin([t])
        in_group = {t}
        assert pager.usage()["resident"]["count"] <= 10
        served += 1
        pager.unpin([t])
        in_group = set()
    assert served == 500 and pager.usage()["parked"]["count"] + pager.usage()["resident"]["count"] <= 50
    with pytest.raises(RuntimeError, match="not resident"):
        pager.pin([next(n for n, x in pager.entries.items() if x.tier != "resident")])


def test_an_auto_budget_is_none_on_a_cpu_and_a_number_stays_as_given():
    assert SlotBudget("auto").placed("cpu") is None
    assert SlotBudget("auto", parked_bytes=10).placed("cpu") == SlotBudget(None, 10)
    assert SlotBudget(100, 10).placed("cpu") == SlotBudget(100, 10)

