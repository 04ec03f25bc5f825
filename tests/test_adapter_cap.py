"""At most K distinct adapters in one backbone call (`max_adapters_per_group`): the tenants beyond K go
to the next group, every answer stays what it would be uncapped, and the cap holds through the services."""

import random

import pytest
import torch

from vlamux.model import ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, Sample, plan_groups
from vlamux.model.synthetic import TaskProfile, make_batch

PROFILE = TaskProfile({"top": (32, 32)}, 4, 6, 3, "reach the {color} block")
# six tenants with adapters of different ranks and two without, taking turns
TENANTS = {f"a{i}": {"rank": 2 + i % 3} for i in range(6)} | {"p0": None, "p1": None}


def head(adapter) -> HeadSpec:
    return HeadSpec("gaussian", 4, 6, 3, width=32, depth=1, adapter=adapter)


def runner(backbone, cap) -> ModelRunner:
    r = ModelRunner(backbone, max_adapters_per_group=cap)
    for i, (t, a) in enumerate(TENANTS.items()):
        r.create_slot(t, head(a), OptimizerSpec(lr=3e-3), seed=10 + i)
    return r


def test_plan_groups_never_puts_more_than_k_adapters_in_a_group():
    rng = random.Random(0)
    for _ in range(1000):
        n, k = rng.randint(1, 30), rng.randint(1, 5)
        keys = [rng.choice("xy") for _ in range(n)]
        adapters = [rng.choice([None, None, "a", "b", "c", "d", "e", "f", "g"]) for _ in range(n)]
        rows = [rng.randint(1, 4) for _ in range(n)]
        groups = plan_groups(keys, rows, 12, adapters=adapters, max_adapters=k)
        assert sorted(i for g in groups for i in g) == list(range(n))  # every request, once
        for g in groups:
            assert len({keys[i] for i in g}) == 1 and sum(rows[i] for i in g) <= max(12, max(rows[i] for i in g))
            assert len({adapters[i] for i in g} - {None}) <= k
            assert g == sorted(g)
    # the request that would be the K+1-th adapter starts a new group; repeats and no-adapter rows do not
    assert plan_groups(["x"] * 5, [1] * 5, adapters=["a", "b", "a", None, "c"], max_adapters=2) == [[0, 1, 2, 3], [4]]
    assert plan_groups(["x"] * 3, [1] * 3, adapters=["a", "b", "c"]) == [[0, 1, 2]]  # uncapped


def test_a_runner_with_k_adapters_a_call_answers_as_uncapped(backbone):
    capped, free = runner(backbone, 2), runner(backbone, None)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        data = {t: make_batch(PROFILE, 2, g) for t in TENANTS}
        fb = [ForwardBackward(t, obs, act) for t, (obs, act) in data.items()]
        for a, b in zip(capped.execute(fb), free.execute(fb)):
            assert abs(a.unwrap()["loss"] - b.unwrap()["loss"]) <= 1e-5 * max(1.0, abs(b.unwrap()["loss"])), a.tenant
        for t in TENANTS:
            capped.optim_step(t).unwrap()
            free.optim_step(t).unwrap()
        samples = [Sample(t, obs, deterministic=True) for t, (obs, _) in data.items()]
        for a, b in zip(capped.execute(samples), free.execute(samples)):
            assert torch.allclose(a.unwrap()["actions"], b.unwrap()["actions"], atol=1e-5), a.tenant
    assert capped.adapter_stats["max_adapters_per_call"] == 2
    assert free.adapter_stats["max_adapters_per_call"] == 6


def test_the_cap_holds_through_the_services():
    from vlamux.model import BackboneSpec
    from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig

    with pytest.raises(ValueError, match="max_adapters_per_group"):
        RuntimeConfig(backbone=BackboneSpec(preset="tiny"), max_adapters_per_group=0)
    rt = EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny"), group_cap=None,
                                       max_adapters_per_group=3)).start()
    try:
        for i, (t, a) in enumerate(TENANTS.items()):
            rt.create_slot(t, head(a), OptimizerSpec(lr=3e-3), seed=i).result(60)
        assert rt.flush(30)
        g = torch.Generator().manual_seed(1)
        data = {t: make_batch(PROFILE, 1, g) for t in TENANTS}
        for _ in range(3):  # all at once: the queues hand them over together
            for f in [rt.forward_backward(t, obs, act) for t, (obs, act) in data.items()]:
                assert f.result(60)["loss"] > 0
            for f in [rt.predict(t, obs) for t, (obs, _) in data.items()]:
                assert f.result(60)["actions"].shape == (1, 6, 4)
        metrics = rt.metrics()
        for svc in [metrics["training"], *metrics["inference"].values()]:
            assert 1 <= svc["adapters"]["max_adapters_per_call"] <= 3, svc["adapters"]
    finally:
        rt.stop()
