"""The embedded runtime with its Health Manager: restarts in place, elastic replicas, nothing dropped."""

import threading
import time

import pytest
import torch

from conftest import TENANTS, tenant_batches
from runtime_cases import (Clients, Roles, killed_environment_worker_is_replaced, killed_inference_replica_restarts,
                           replicas_added_and_removed_under_load, wait_for)
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


@pytest.fixture
def runtime_hung_after_1s():
    rt = started(hung_after_s=1.0)
    yield rt
    rt.stop()


def crash(service):
    """What an unhandled error in the engine thread does: the thread ends, the queue is left as it is."""
    service._running = False
    service._thread.join(5)


ROLES = Roles(kill_replica=lambda rt, name: crash(rt.replicas[name]),
              replica_version=lambda rt, name, tenant: rt.replicas[name].policy_version(tenant), timeout_s=20.0)


def test_killed_inference_replica_is_restarted_and_requests_keep_succeeding(runtime):
    victim = runtime.replicas["inference-0"]
    killed_inference_replica_restarts(runtime, ROLES)
    assert runtime.replicas["inference-0"] is not victim and runtime.replicas["inference-0"].alive()


@pytest.mark.serial  # silent for 1 s counts as hung: beside a neighbour a healthy engine could stall that long
def test_hung_inference_replica_is_replaced(runtime_hung_after_1s):
    runtime = runtime_hung_after_1s
    victim = runtime.replicas["inference-1"]
    release = threading.Event()
    victim.run_once = lambda timeout=None: release.wait(30)  # a stuck model call
    with Clients(runtime, ["acme", "delta"]) as c:
        assert wait_for(lambda: runtime.replicas["inference-1"] is not victim, 15)
        before = dict(c.ok)
        assert wait_for(lambda: all(c.ok[t] > before[t] + 3 for t in ["acme", "delta"]))
    release.set()
    assert c.errors == []


def test_killed_training_role_comes_back_with_its_tenants(runtime, tmp_path):
    data = tenant_batches(batch=2)
    for t, (obs, act) in data.items():
        runtime.forward_backward(t, obs, act).result(30)
        runtime.optim_step(t).result(30)
    runtime.save_state("acme", tmp_path / "acme.safetensors").result(30)
    obs, act = data["acme"]
    runtime.forward_backward("acme", obs, act).result(30)
    runtime.optim_step("acme").result(30)  # version 2, after the checkpoint
    assert runtime.publisher.flush(10)
    old = runtime.training
    with Clients(runtime, ["bolt", "cobalt"]) as c:
        crash(old)
        assert wait_for(lambda: runtime.training is not old and runtime.training.alive())
        time.sleep(0.3)
    assert c.errors == [] and all(v > 0 for v in c.ok.values())
    # from its checkpoint (version 1); version 2 was already served, so its weights come back as
    # version 3, which the replicas switch to: a version number never names two policies
    assert runtime.training.version("acme") == 3
    assert runtime.publisher.flush(10)
    ckpt = runtime.training.runner.slot("acme").export_policy().tensors
    served = runtime.predict("acme", obs, deterministic=True).result(30)
    assert served["policy_version"] == 3
    replica = next(iter(runtime.replicas.values())).runner.slot("acme")
    assert all(torch.equal(ckpt[k], v) for k, v in replica.export_policy().tensors.items())
    assert runtime.training.version("bolt") == 1  # from its last published version
    out = runtime.forward_backward("bolt", *data["bolt"]).result(30)  # training goes on
    assert out["loss"] > 0 and runtime.optim_step("bolt").result(30)["policy_version"] == 2


def test_killed_environment_worker_is_replaced_by_the_health_manager(runtime):
    killed_environment_worker_is_replaced(runtime, 15.0)


def test_elastic_replicas_added_and_removed_under_load(runtime):
    replicas_added_and_removed_under_load(runtime, 20.0)
