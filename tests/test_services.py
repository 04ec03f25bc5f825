"""Training and Inference Model Services on the embedded runtime: concurrency, grouping, versions."""

import dataclasses
import threading

import pytest
import torch

from conftest import TENANTS, chunks_while_training, light_latency_alone_and_flooded, make_runner, tenant_batches
from vlamux.errors import UnknownTenantError
from vlamux.model import ForwardBackward, OptimizerSpec, Sample, Slot
from vlamux.services.control import PolicyPublisher
from vlamux.services.inference import InferenceModelService
from vlamux.services.queues import InferenceQueueConfig, StaleError
from vlamux.services.training import TrainingModelService


@pytest.fixture
def services(backbone):
    pub = PolicyPublisher()
    pub.start()
    train = TrainingModelService(backbone, pub, max_staleness=2).start()
    infer = InferenceModelService(backbone, InferenceQueueConfig(batch_rows=16, max_wait_s=0.01)).start()
    pub.subscribe(infer.name, infer.stage_policy)
    for i, (name, (spec, _)) in enumerate(TENANTS.items()):
        train.create_slot(name, spec, OptimizerSpec(lr=1e-3), seed=100 + i).result(10)
    assert pub.flush(10)
    yield train, infer, pub
    train.stop()
    infer.stop()
    pub.stop()


def test_concurrent_training_equals_serial(services, backbone):
    train, _, _ = services
    serial = make_runner(backbone)
    for step in range(3):
        data = tenant_batches(batch=2, seed=step)
        got, errors = {}, []

        def tenant_loop(t, obs, act):  # every tenant drives its own job from its own thread
            try:
                got[t] = train.forward_backward(t, obs, act).result(30)["loss"]
                train.optim_step(t).result(30)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=tenant_loop, args=(t, o, a)) for t, (o, a) in data.items()]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        want = {r.tenant: r.unwrap()["loss"] for r in
                serial.execute([ForwardBackward(t, o, a) for t, (o, a) in data.items()], grouped=False)}
        for t in TENANTS:
            serial.optim_step(t)
            assert abs(got[t] - want[t]) <= 1e-5, (step, t, got, want)
    assert all(train.version(t) == 3 for t in TENANTS)
    assert train.queue.stats.group_requests and max(train.queue.stats.group_requests) > 1  # it did group


def test_inference_serves_the_published_version(services, backbone):
    train, infer, pub = services
    data = tenant_batches(batch=2)
    for t, (obs, act) in data.items():
        train.forward_backward(t, obs, act).result(30)
        train.optim_step(t).result(30)
    assert pub.flush(10)
    futures = {t: infer.predict(t, obs, deterministic=True) for t, (obs, _) in data.items()}
    for t, f in futures.items():
        out = f.result(30)
        assert out["policy_version"] == 1 == train.version(t)
        # the replica's actions are those of the trained slot: same weights travelled
        expected = train.runner.execute([Sample(t, data[t][0], True)])[0].unwrap()["actions"]
        assert (out["actions"] - expected).abs().max() <= 1e-5


def test_version_switch_is_atomic_between_groups(services):
    train, infer, pub = services
    obs, act = tenant_batches(batch=1)["acme"]

    def step():
        train.forward_backward("acme", obs, act).result(30)
        train.optim_step("acme").result(30)

    seen = chunks_while_training(lambda: infer.predict("acme", obs, deterministic=True).result(30), step, 4,
                                 lambda: pub.flush(10))
    versions = [s["policy_version"] for s in seen]
    assert versions == sorted(versions)  # never goes back
    by_version = {}
    for s in seen:  # one version, one policy: a chunk is never produced by half-switched weights
        ref = by_version.setdefault(s["policy_version"], s["actions"])
        assert torch.equal(ref, s["actions"])


def test_unknown_tenant_and_stale_batches_fail_clearly(services):
    train, infer, _ = services
    obs, act = tenant_batches(batch=1)["acme"]
    with pytest.raises(UnknownTenantError, match="nobody"):
        infer.predict("nobody", obs)
    for _ in range(3):
        train.forward_backward("acme", obs, act).result(30)
        train.optim_step("acme").result(30)
    with pytest.raises(StaleError, match="3 versions behind"):
        train.forward_backward("acme", obs, act, policy_version=0).result(30)
    assert train.forward_backward("acme", obs, act, policy_version=1).result(30)["loss"] > 0


def test_control_plane_carries_only_the_tenant_module(services, backbone):
    train, _, pub = services
    snap = train.runner.slot("acme").export_policy()
    assert all(k.startswith(("head.", "stats.")) for k in snap.tensors)
    backbone_bytes = sum(p.numel() * p.element_size() for p in backbone.parameters())
    assert snap.nbytes() < backbone_bytes and pub.delivered >= len(TENANTS)
    replica = Slot.from_policy(snap, backbone.meta)
    for a, b in zip(replica.head.parameters(), train.runner.slot("acme").head.parameters()):
        assert torch.equal(a, b)


def test_one_tenants_failure_does_not_disturb_the_others(services):
    train, infer, _ = services
    data = tenant_batches(batch=2)
    bad = data["bolt"][1].clone()
    bad[0, 0, 0] = float("nan")
    futures = {t: train.forward_backward(t, o, bad if t == "bolt" else a) for t, (o, a) in data.items()}
    assert isinstance(futures["bolt"].exception(30), ValueError)
    assert all(f.result(30)["loss"] > 0 for t, f in futures.items() if t != "bolt")
    with pytest.raises(ValueError, match="optim_step"):  # bolt accumulated nothing
        train.optim_step("bolt").result(30)
    assert infer.alive() and train.alive()


@pytest.mark.serial
def test_a_flooding_tenant_delays_a_light_tenant_by_a_group_not_its_queue(backbone):
    """Least-served-first scheduling: next to a tenant keeping 20 groups' worth of requests queued, a light
    tenant's median latency stays within a few of the flood's group periods (FIFO would be ~20)."""
    from vlamux.model import Slot

    svc = InferenceModelService(backbone, InferenceQueueConfig(batch_rows=8, max_wait_s=0.05)).start()
    data = tenant_batches(batch=1)
    for i, (t, (spec, _)) in enumerate(TENANTS.items()):
        svc.stage_policy(Slot(t, spec, backbone.meta, seed=i).export_policy())

    try:
        alone, flooded, period = light_latency_alone_and_flooded(
            lambda: svc.predict("acme", data["acme"][0], deterministic=True).result(30),
            lambda: svc.predict("delta", data["delta"][0]), batch_rows=8)
    finally:
        svc.stop()
    # Least-served-first: the light request joins the next group, so it waits the current group's rest and its
    # own; FIFO would queue it behind 20 groups. Both 2x alone and 4 periods allow for the machine's jitter.
    assert flooded <= max(2 * alone, 4 * period), (flooded, alone, period)


def test_a_checkpoint_rollback_gets_a_new_version_and_reaches_inference(services, tmp_path):
    train, infer, pub = services
    obs, act = tenant_batches(batch=1)["acme"]
    train.forward_backward("acme", obs, act).result(30)
    train.optim_step("acme").result(30)
    train.save_state("acme", tmp_path / "v1.safetensors").result(30)
    assert pub.flush(10)
    want = infer.predict("acme", obs, deterministic=True).result(30)
    assert want["policy_version"] == 1
    train.forward_backward("acme", obs, act).result(30)
    train.optim_step("acme").result(30)  # version 2 is served
    assert train.load_state("acme", tmp_path / "v1.safetensors").result(30)["policy_version"] == 3
    assert pub.flush(10)
    infer_actions = infer.predict("acme", obs, deterministic=True).result(30)
    assert infer_actions["policy_version"] == 3  # version 1's weights under a new number, not 1 again
    assert torch.equal(infer_actions["actions"], want["actions"])


def test_set_lr_keeps_or_forgets_the_optimizer_moments_and_touches_only_its_tenant(services):
    train, _, _ = services
    data = tenant_batches(batch=2)
    for t in ("acme", "bolt"):
        train.forward_backward(t, *data[t]).result(30)
        train.optim_step(t).result(30)
    slot, other = train.runner.slot("acme"), train.runner.slot("bolt")
    moments = {id(p): s["exp_avg_sq"].clone() for p, s in other.optimizer.state.items()}
    assert train.set_lr("acme", 5e-4).result(30) == {"lr": 5e-4, "fresh_moments": False}
    assert slot.optimizer.state and all(g["lr"] == 5e-4 for g in slot.optimizer.param_groups)
    train.set_lr("acme", 2e-4, fresh_moments=True).result(30)
    assert not slot.optimizer.state and slot.optim_spec.lr == 2e-4
    train.forward_backward("acme", *data["acme"]).result(30)
    train.optim_step("acme").result(30)
    assert {int(s["step"]) for s in slot.optimizer.state.values()} == {1}  # Adam started over
    assert other.optim_spec.lr == 1e-3 and all(torch.equal(s["exp_avg_sq"], moments[id(p)])
                                               for p, s in other.optimizer.state.items())
    with pytest.raises(Exception, match="lr: expected a positive number"):
        train.set_lr("acme", 0)


def test_a_removed_slot_leaves_training_and_the_replica_and_a_served_checkpoint_replaces_it(services):
    """remove_slot frees the tenant's slot in training and (the control plane's retirement) on the
    replica, after its queued operations; the others keep theirs. A policy served again afterwards from
    an older version (a finished job's checkpoint) replaces whatever the replica held, even when its
    retirement and the new version are staged together before a group applies them."""
    train, infer, pub = services
    data = tenant_batches(batch=2)
    obs, act = data["acme"]
    train.forward_backward("acme", obs, act).result(30)
    train.optim_step("acme").result(30)
    old = train.export_policy("acme").result(30).ready()
    train.forward_backward("acme", obs, act).result(30)
    train.optim_step("acme").result(30)  # version 2: newer than `old`
    assert pub.flush(10) and infer.predict("acme", obs, True).result(30)["policy_version"] == 2
    train.remove_slot("acme").result(30)
    assert pub.flush(10)
    infer.run_once(0.0)  # between groups: the retirement applies
    assert "acme" not in train.tenants() and "acme" not in infer.runner.slots and not infer.serves("acme")
    with pytest.raises(UnknownTenantError):
        infer.predict("acme", obs, True)
    with pytest.raises(UnknownTenantError):
        train.optim_step("acme").result(30)
    assert {"bolt", "cobalt", "delta"} <= set(train.tenants()) and {"bolt", "cobalt", "delta"} <= set(infer.runner.slots)
    assert infer.predict("bolt", data["bolt"][0], True).result(30)["policy_version"] == 0

    pub.publish(old)  # served again from its checkpoint (version 1)
    assert pub.flush(10) and infer.predict("acme", obs, True).result(30)["policy_version"] == 1
    pub.retire("acme")
    pub.publish(dataclasses.replace(old, version=0))  # retired and served again before any group: replaced
    assert pub.flush(10) and infer.predict("acme", obs, True).result(30)["policy_version"] == 0
