"""The Inference and Training Queues' scheduling decisions."""

import threading
import time

import pytest

from vlamux.services.queues import (DeadlineExceeded, InferenceQueue, InferenceQueueConfig, QueueClosed, StaleError,
                                    TrainingQueue, TrainOp)


def test_group_dispatches_when_b_rows_are_queued():
    q = InferenceQueue(InferenceQueueConfig(batch_rows=4, max_wait_s=60))
    q.submit("a", 3, "x")
    assert q.next_group(timeout=0.05) == []  # 3 rows < B and T not reached
    q.submit("b", 1, "y")
    group = q.next_group(timeout=0)
    assert [g.payload for g in group] == ["x", "y"]


def test_group_dispatches_when_oldest_waited_t():
    q = InferenceQueue(InferenceQueueConfig(batch_rows=100, max_wait_s=0.05))
    q.submit("a", 1, "x")
    t0 = time.monotonic()
    group = q.next_group(timeout=5)
    assert [g.payload for g in group] == ["x"]
    assert time.monotonic() - t0 >= 0.05 - 1e-3  # not before T
    assert q.stats.waits[-1] >= 0.05 - 1e-3


def test_a_group_holds_at_most_b_rows_but_a_big_request_runs_alone():
    q = InferenceQueue(InferenceQueueConfig(batch_rows=4, max_wait_s=0))
    for i in range(3):
        q.submit("a", 2, i)
    assert [g.payload for g in q.next_group(0)] == [0, 1]
    assert [g.payload for g in q.next_group(0)] == [2]
    q.submit("b", 9, "big")
    assert [g.payload for g in q.next_group(0)] == ["big"]


def serve_rounds(q, light_every: int, rounds: int, flood: bool):
    """Drive the queue: the flood tenant keeps 20 requests queued; the light tenant submits one request
    every `light_every` groups. Returns how many groups each light request waited before its own."""
    waits, pending = [], {}
    for r in range(rounds):
        if flood:
            while q.depth()[0] - len(pending) < 20:
                q.submit("flood", 1, ("flood", r))
        if r % light_every == 0:
            pending[r] = q.submit("light", 1, ("light", r))
        for item in q.next_group(0):
            if item.payload[0] == "light":
                waits.append(r - item.payload[1])
                pending.pop(item.payload[1])
    return waits


def test_fair_share_a_flooding_tenant_does_not_starve_a_light_one():
    cfg = InferenceQueueConfig(batch_rows=4, max_wait_s=0)
    alone = serve_rounds(InferenceQueue(cfg), light_every=3, rounds=60, flood=False)
    flooded = serve_rounds(InferenceQueue(cfg), light_every=3, rounds=60, flood=True)
    assert len(flooded) == len(alone) == 20
    # least-served first: the light tenant is served in the very next group, flood or not
    assert max(flooded) == max(alone) == 0


def test_a_returning_tenant_is_lifted_not_given_a_monopoly():
    q = InferenceQueue(InferenceQueueConfig(batch_rows=2, max_wait_s=0))
    for i in range(10):
        q.submit("busy", 1, ("busy", i))
    for _ in range(3):
        q.next_group(0)  # busy has been served 6 rows
    q.submit("newcomer", 1, ("newcomer", 0))
    q.submit("newcomer", 1, ("newcomer", 1))
    q.submit("newcomer", 1, ("newcomer", 2))
    kinds = [g.payload[0] for g in q.next_group(0)] + [g.payload[0] for g in q.next_group(0)]
    assert "newcomer" in kinds and "busy" in kinds  # shared, not all four to the newcomer


def test_request_past_its_deadline_fails_clearly():
    q = InferenceQueue(InferenceQueueConfig(batch_rows=100, max_wait_s=10))
    f = q.submit("a", 1, "x", deadline_s=0.02)
    assert q.next_group(timeout=0.2) == []
    with pytest.raises(DeadlineExceeded, match="tenant 'a'"):
        f.result(timeout=1)


def test_close_fails_what_is_queued():
    q = InferenceQueue()
    f = q.submit("a", 1, "x")
    q.close()
    with pytest.raises(QueueClosed):
        f.result(timeout=1)
    with pytest.raises(QueueClosed):
        q.submit("a", 1, "y")


def test_next_group_wakes_for_a_submission_from_another_thread():
    q = InferenceQueue(InferenceQueueConfig(batch_rows=1, max_wait_s=10))
    threading.Timer(0.05, lambda: q.submit("a", 1, "x")).start()
    assert [g.payload for g in q.next_group(timeout=5)] == ["x"]


def test_metrics_report_depth_waits_and_group_sizes():
    q = InferenceQueue(InferenceQueueConfig(batch_rows=2, max_wait_s=0))
    for t in "abc":
        q.submit(t, 1, t)
    q.next_group(0)
    m = q.metrics()
    assert m["depth_requests"] == 1 and m["depth_rows"] == 1 and m["groups"] == 1 and m["group_rows_mean"] == 2


# ---- Training Queue ------------------------------------------------------------------------------

def test_training_queue_fifo_per_tenant_one_in_flight():
    q = TrainingQueue(gather_s=0)
    ops = [q.submit(TrainOp("a", "forward_backward", i, rows=1)) for i in range(2)]
    q.submit(TrainOp("b", "forward_backward", "b0", rows=1))
    batch = q.next_batch(0)
    assert sorted((op.tenant, op.payload) for op in batch) == [("a", 0), ("b", "b0")]
    assert q.next_batch(0) == []  # a's second op waits until its first is done
    q.done("a")
    assert [op.payload for op in q.next_batch(0)] == [1]
    assert len(ops) == 2


def test_training_queue_priority_when_rows_are_capped():
    q = TrainingQueue(max_group_rows=4, gather_s=0)
    q.submit(TrainOp("low", "forward_backward", rows=4, priority=0))
    q.submit(TrainOp("high", "forward_backward", rows=4, priority=5))
    assert [op.tenant for op in q.next_batch(0)] == ["high"]
    assert [op.tenant for op in q.next_batch(0)] == ["low"]


def test_training_queue_readiness():
    gate = threading.Event()
    q = TrainingQueue(gather_s=0)
    q.submit(TrainOp("a", "forward_backward", rows=1, ready=gate.is_set))
    q.submit(TrainOp("b", "optim_step"))
    assert [op.tenant for op in q.next_batch(0)] == ["b"]
    assert q.next_batch(timeout=0.05) == []
    gate.set()
    assert [op.tenant for op in q.next_batch(timeout=1)] == ["a"]


def test_training_queue_staleness_limit():
    versions = {"a": 10}
    q = TrainingQueue(version_of=versions.get, max_staleness=2, gather_s=0)
    stale = q.submit(TrainOp("a", "forward_backward", rows=1, policy_version=7))
    fresh = q.submit(TrainOp("a", "forward_backward", "ok", rows=1, policy_version=8))
    assert [op.payload for op in q.next_batch(0)] == ["ok"]
    with pytest.raises(StaleError, match="3 versions behind"):
        stale.result(timeout=1)
    assert not fresh.done()


def test_training_queue_gathers_other_tenants_briefly():
    q = TrainingQueue(gather_s=0.2)
    for tenant in "ab":  # both tenants become known to the queue
        q.submit(TrainOp(tenant, "forward_backward", rows=1))
    assert len(q.next_batch(0)) == 2
    q.done("a")
    q.done("b")
    q.submit(TrainOp("a", "forward_backward", rows=1))
    threading.Timer(0.05, lambda: q.submit(TrainOp("b", "forward_backward", rows=1))).start()
    assert sorted(op.tenant for op in q.next_batch(timeout=1)) == ["a", "b"]
