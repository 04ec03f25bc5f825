"""Jobs waiting for the service's capacity (vlamux/jobs/job_queue.py): fair order across tenants, and a
start estimate from the running jobs' progress that says None rather than guess."""

import random

from vlamux.jobs.job_queue import Running, Waiting, estimate_starts, fair_order, remaining_s

ONE = {"jobs": 1}


def w(job, tenant, t, need=ONE, kind="sft"):
    return Waiting(job, tenant, kind, need, t)


def test_a_tenant_with_many_queued_jobs_does_not_hold_the_others_back():
    waiting = [w(f"a{i}", "alice", i) for i in range(5)] + [w("b0", "bob", 10), w("c0", "carol", 11), w("b1", "bob", 12)]
    order = [x.job_id for x in fair_order(waiting, [])]
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]
    # a tenant already running takes its turn after those who are not; then, at equal load, the tenant
    # that started a job least recently (bob's started before alice's next could)
    running = [Running("r", "bob", "sft", ONE, 0.0, 0.5)]
    assert [x.job_id for x in fair_order(waiting, running)][:4] == ["a0", "c0", "b0", "a1"]
    # a tenant whose job just ended goes after one that waited behind it
    assert [x.job_id for x in fair_order([w("a1", "alice", 1), w("b0", "bob", 10)], [], {"alice": 50.0})] == \
        ["b0", "a1"]


def test_each_tenants_jobs_start_oldest_first_and_every_job_once():
    rng = random.Random(0)
    for _ in range(300):
        waiting = [w(f"j{i}", rng.choice("abcd"), rng.random()) for i in range(rng.randint(0, 20))]
        order = fair_order(waiting, [])
        assert sorted(x.job_id for x in order) == sorted(x.job_id for x in waiting)
        for t in "abcd":
            mine = [x.submitted for x in order if x.tenant == t]
            assert mine == sorted(mine)


def test_the_estimate_comes_from_progress():
    now = 100.0
    assert remaining_s(Running("r", "t", "sft", ONE, 40.0, 0.25), now) == 180.0  # 60 s for a quarter
    assert remaining_s(Running("r", "t", "sft", ONE, 40.0, None), now) is None
    assert remaining_s(Running("r", "t", "sft", ONE, 40.0, None), now, {"sft": 100.0}) == 40.0
    running = [Running("r1", "x", "sft", ONE, 40.0, 0.25), Running("r2", "y", "rl", ONE, 90.0, 0.5)]
    order = fair_order([w("a", "alice", 1), w("b", "bob", 2), w("c", "carol", 3)], running)
    places = estimate_starts(order, running, {"jobs": 2}, now, {"sft": 50.0})
    assert [(p.position, p.of) for p in places] == [(1, 3), (2, 3), (3, 3)]
    # r2 ends in 10 s (half done in 10 s): a starts then and, an SFT job, ends at 60 s: b starts then and
    # ends at 110 s, before r1 (180 s): c starts then
    assert [p.eta_s for p in places] == [10.0, 60.0, 110.0]


def test_a_start_that_cannot_be_estimated_is_none_and_so_is_every_later_one():
    running = [Running("r", "x", "rl", ONE, 0.0, None)]
    order = fair_order([w("a", "alice", 1), w("b", "bob", 2)], running)
    assert [p.eta_s for p in estimate_starts(order, running, {"jobs": 1}, 10.0)] == [None, None]
    # with room now, the first starts at once; the second waits for the first's unknown end
    assert [p.eta_s for p in estimate_starts(order, [], {"jobs": 1}, 10.0)] == [0.0, None]


def test_resources_other_than_jobs_count_too():
    running = [Running("r", "x", "rl", {"jobs": 1, "env_processes": 6}, 0.0, 0.5)]  # ends in 10 s
    order = [w("a", "alice", 1, {"jobs": 1, "env_processes": 4}), w("b", "bob", 2, {"jobs": 1, "env_processes": 2})]
    places = estimate_starts(order, running, {"jobs": 4, "env_processes": 8}, 10.0)
    assert [p.eta_s for p in places] == [10.0, 10.0]  # a needs r's processes; b starts behind a (no overtaking)


def test_random_queues_start_in_order_and_never_over_capacity():
    rng = random.Random(1)
    for _ in range(500):
        running = [Running(f"r{i}", rng.choice("xyz"), rng.choice(["sft", "rl"]), {"jobs": 1, "env": rng.randint(0, 4)},
                           rng.uniform(0, 50), rng.choice([None, rng.uniform(0.01, 1.0)])) for i in range(rng.randint(0, 4))]
        waiting = [w(f"j{i}", rng.choice("abc"), rng.random(), {"jobs": 1, "env": rng.randint(0, 4)},
                     rng.choice(["sft", "rl"])) for i in range(rng.randint(0, 8))]
        typical = rng.choice([None, {"sft": 30.0}, {"sft": 30.0, "rl": 60.0}])
        places = estimate_starts(fair_order(waiting, running), running, {"jobs": 4, "env": 8}, 60.0, typical)
        etas = [p.eta_s for p in places]
        known = [e for e in etas if e is not None]
        assert known == etas[:len(known)]  # once unknown, unknown after
        assert known == sorted(known) and all(e >= 0 for e in known)  # no job overtakes the one before it
