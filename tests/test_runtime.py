"""The embedded runtime with its Health Manager: restarts in place, elastic replicas, nothing dropped."""

import threading
import time

import pytest
import torch

from conftest import TENANTS
from runtime_cases import (Roles, hung_inference_replica_is_replaced, killed_environment_worker_is_replaced,
                           killed_inference_replica_restarts, killed_training_role_comes_back,
                           replicas_added_and_removed_under_load)
from vlamux.model import BackboneSpec, OptimizerSpec
from vlamux.services.queues import InferenceQueueConfig
from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig


def started(hung_after_s: float) -> EmbeddedRuntime:
    cfg = RuntimeConfig(backbone=BackboneSpec(preset="tiny"), inference_replicas=2,
                        inference_queue=InferenceQueueConfig(batch_rows=8, max_wait_s=0.005),
                        health_interval_s=0.1, hung_after_s=hung_after_s, env_check_every_s=0.2)
    rt = EmbeddedRuntime(cfg).start()
    for i, (name, (spec, _)) in enumerate(TENANTS.items()):
        rt.create_slot(name, spec, OptimizerSpec(lr=1e-3), seed=i).result(30)
    assert rt.publisher.flush(10)
    return rt


@pytest.fixture
def runtime():
    """An engine silent for 10 s counts as hung: the crashes below end their threads, which the Health
    Manager sees at once, and a busy neighbour's stalls never make a healthy engine look hung."""
    rt = started(hung_after_s=10.0)
    yield rt
    rt.stop()


def crash(service):
    """What an unhandled error in the engine thread does: the thread ends, the queue is left as it is."""
    service._running = False
    service._thread.join(5)


def hang(service):
    """A stuck model call: the engine thread waits in it until released."""
    release = threading.Event()
    service.run_once = lambda timeout=None: release.wait(30)
    return release.set


ROLES = Roles(kill_replica=lambda rt, name: crash(rt.replicas[name]), kill_training=lambda rt: crash(rt.training),
              replica_version=lambda rt, name, tenant: rt.replicas[name].policy_version(tenant),
              hang_replica=lambda rt, name: hang(rt.replicas[name]), timeout_s=20.0)


def test_killed_inference_replica_is_restarted_and_requests_keep_succeeding(runtime):
    victim = runtime.replicas["inference-0"]
    killed_inference_replica_restarts(runtime, ROLES)
    assert runtime.replicas["inference-0"] is not victim and runtime.replicas["inference-0"].alive()


@pytest.mark.serial  # silent for 1 s counts as hung: beside a neighbour a healthy engine could stall that long
def test_hung_inference_replica_is_replaced(runtime):
    victim = runtime.replicas[runtime.replica_names()[-1]]
    hung_inference_replica_is_replaced(runtime, ROLES, hung_after_s=1.0)
    assert runtime.replicas[runtime.replica_names()[-1]] is not victim


def test_killed_training_role_comes_back_with_its_tenants(runtime, tmp_path):
    old = runtime.training
    killed_training_role_comes_back(runtime, ROLES, tmp_path / "acme.safetensors")
    assert runtime.training is not old and runtime.training.alive()
    # the replicas serve the checkpoint's weights
    ckpt = runtime.training.runner.slot("acme").export_policy().tensors
    for replica in runtime.replicas.values():
        served = replica.runner.slot("acme").export_policy().tensors
        assert all(torch.equal(ckpt[k], v) for k, v in served.items())


def test_killed_environment_worker_is_replaced_by_the_health_manager(runtime):
    killed_environment_worker_is_replaced(runtime, 15.0)


def test_elastic_replicas_added_and_removed_under_load(runtime):
    replicas_added_and_removed_under_load(runtime, 20.0)


def test_a_long_training_round_that_makes_progress_is_not_taken_for_a_hang(runtime):
    """A round of many tenants' operations may outlast `hung_after_s` while each operation ends in
    time (fifty Meta-World tenants on two cores did): the heartbeat follows the operations, so the
    training role is not restarted under its jobs. Each operation is slowed here (0.4 s; the real
    ones are too quick to outlast a test's bound), and the round is made one batch by holding the
    engine back until every tenant's operation is queued."""
    svc, go = runtime.training, threading.Event()
    run_op, next_batch = svc._run_op, svc.queue.next_batch

    def slow(op):
        time.sleep(0.4)
        return run_op(op)

    def gated(*a, **k):
        go.wait(10)
        return next_batch(*a, **k)

    svc._run_op, svc.queue.next_batch = slow, gated
    runtime.health.hung_after_s = 1.0
    try:
        time.sleep(0.2)  # the engine now waits at the gate
        futures = [runtime.set_lr(name, 1e-4) for name in TENANTS]
        go.set()
        t0 = time.monotonic()
        for f in futures:
            assert f.result(20)["lr"] == 1e-4
        assert time.monotonic() - t0 > 1.2  # one round of four operations, longer than hung_after_s
        time.sleep(0.5)
        assert runtime.training is svc and runtime.health.roles["training"].restarts == 0
    finally:
        runtime.health.hung_after_s = 10.0
        svc._run_op, svc.queue.next_batch = run_op, next_batch
