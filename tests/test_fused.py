"""Fused heads: same-architecture heads of a group run as one call and change nothing a tenant sees.

The per-tenant loop (fuse=False) is the reference: fused outputs, gradients, RNG streams and 50-step
loss trajectories equal it (fp32, <= 1e-5; for gradients relative to their scale where it exceeds 1), tenants keep their own learning rates, and one tenant's
step or NaN leaves every other tenant's slot byte-identical.
"""

import pytest
import torch

from conftest import same_bytes, snapshot
from vlamux.errors import NonFiniteError
from vlamux.model import ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, PolicyLoss, Sample
from vlamux.model.fused import architecture
from vlamux.model.synthetic import TaskProfile, make_batch

TOL = 1e-5
KINDS = ["gaussian", "bins", "flow", "l1_chunk"]
# Five tenants per head kind: different learning rates, cameras, image sizes, phrasing and batch sizes,
# so the fused call pads rows and tokens.
PROFILES = [
    (TaskProfile({"top": (32, 32)}, 4, 6, 3, "reach the {color} block"), 2),
    (TaskProfile({"top": (40, 56), "wrist": (32, 32)}, 4, 6, 3, "please push the {color} cube to the left"), 3),
    (TaskProfile({"top": (32, 32)}, 4, 6, 3, "{color}"), 1),
    (TaskProfile({"top": (64, 64), "wrist": (32, 32), "side": (32, 48)}, 4, 6, 3, "grab {color} now"), 2),
    (TaskProfile({"top": (48, 48)}, 4, 6, 3, "touch the {color} ball, then stop"), 2),
]
LRS = [1e-3, 3e-4, 2e-3, 5e-4, 1e-3]


def spec(kind: str) -> HeadSpec:
    options = {"n_bins": 16} if kind == "bins" else {"steps": 3} if kind == "flow" else {}
    return HeadSpec(kind, action_dim=4, horizon=6, state_dim=3, width=64, depth=2, options=options)


def runners(backbone, kind: str):
    made = []
    for _ in range(2):
        r = ModelRunner(backbone)
        for i, lr in enumerate(LRS):
            r.create_slot(f"t{i}", spec(kind), OptimizerSpec(lr=lr), seed=10 + i)
        made.append(r)
    return made  # (fused, loop): identical slots


def batches(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": make_batch(p, b, g) for i, (p, b) in enumerate(PROFILES)}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within TOL, relative to the larger of 1 and the tensor's scale (fp32 rounding is relative)."""
    return (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item())


def diff(a, b) -> float:
    """The largest difference of two outputs, relative to the larger of 1 and each tensor's scale (a
    bins head's logits are ~10: their rounding is ten times an action's)."""
    return max((a[k].float() - b[k].float()).abs().max().item() / max(1.0, b[k].float().abs().max().item())
               for k in a if isinstance(a[k], torch.Tensor))


def test_same_architecture_shares_a_fusion_key_and_others_do_not(backbone):
    r = ModelRunner(backbone)
    a = r.create_slot("a", spec("gaussian"), seed=1)
    b = r.create_slot("b", HeadSpec("gaussian", 4, 6, 3, width=64, options={"init_log_std": -1.0}), seed=2)
    c = r.create_slot("c", HeadSpec("gaussian", 4, 6, 3, width=32), seed=3)
    assert architecture(a, "sample") == architecture(b, "sample")  # init-only options do not matter
    assert architecture(a, "sample") != architecture(c, "sample")
    assert architecture(a, "sample") != architecture(a, "supervised")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("deterministic", [True, False])
def test_fused_sampling_equals_the_loop(backbone, kind, deterministic):
    fused, loop = runners(backbone, kind)
    for step in range(3):  # stochastic heads draw from each tenant's generator: later draws match too
        reqs = [Sample(t, obs, deterministic) for t, (obs, _) in batches(step).items()]
        with_fused = fused.run_heads(reqs, _features(fused, reqs), fuse=True)
        with_loop = loop.run_heads(reqs, _features(loop, reqs), fuse=False)
        for a, b in zip(with_fused, with_loop):
            assert a.ok and b.ok, (a.error, b.error)
            assert a.output["actions"].shape == b.output["actions"].shape
            assert diff(a.output, b.output) <= TOL, (kind, a.tenant, diff(a.output, b.output))
    for t in fused.slots:  # the generators moved alike
        assert torch.equal(fused.slot(t).generator.get_state(), loop.slot(t).generator.get_state())


def _features(runner, reqs):
    from vlamux.model import canonicalize

    bb = next(iter(runner.backbones.values()))
    with torch.no_grad():
        return bb.forward_group([canonicalize(r.obs, bb.schema, bb.tokenizer) for r in reqs])


def test_execute_fuses_a_group_and_matches_unfused_execution(backbone):
    """Through execute(): one backbone group, one fused head call, results equal to fuse_heads=False."""
    fused = ModelRunner(backbone)
    plain = ModelRunner(backbone, fuse_heads=False)
    for r in (fused, plain):
        for i, lr in enumerate(LRS):
            r.create_slot(f"t{i}", spec("gaussian"), OptimizerSpec(lr=lr), seed=10 + i)
    data = batches(0)
    reqs = [Sample(t, obs) for t, (obs, _) in data.items()]
    a, b = fused.execute(reqs), plain.execute(reqs)
    assert all(r.group_size == len(reqs) for r in a)
    assert fused.fused.calls == 1 and plain.fused is None  # one fused call, no fallback
    for x, y in zip(a, b):
        assert diff(x.output, y.output) <= TOL
    # the fused call's time is split over the tenants by rows, like the backbone's
    rows = [obs.batch_size for obs, _ in data.values()]
    shares = [r.head_s / rows[i] for i, r in enumerate(a)]
    assert max(shares) - min(shares) <= 1e-9 + 1e-6 * max(shares)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_training_equals_the_loop_over_50_steps(backbone, kind):
    fused, loop = runners(backbone, kind)
    losses = {"fused": {t: [] for t in fused.slots}, "loop": {t: [] for t in fused.slots}}
    for step in range(50):
        data = batches(100 + step)
        reqs = [ForwardBackward(t, obs, act) for t, (obs, act) in data.items()]
        for mode, runner in (("fused", fused), ("loop", loop)):
            feats = _features(runner, reqs)
            for r in runner.run_heads(reqs, feats, fuse=mode == "fused"):
                losses[mode][r.tenant].append(r.unwrap()["loss"])
        if step == 0:  # the first gradients, before any step: equal per tenant and parameter
            for t in fused.slots:
                for pf, pl in zip(fused.slot(t).params, loop.slot(t).params):
                    assert (pf.grad is None) == (pl.grad is None)
                    if pf.grad is not None:
                        assert close(pf.grad, pl.grad), (kind, t)
        for runner in (fused, loop):
            for t in runner.slots:
                assert runner.optim_step(t).unwrap()["policy_version"] == step + 1
    for t in fused.slots:
        f, lp = torch.tensor(losses["fused"][t]), torch.tensor(losses["loop"][t])
        assert (f - lp).abs().max() <= TOL, (kind, t, (f - lp).abs().max())
        if kind != "flow":  # flow's loss draws fresh noise each step: too noisy to compare ends
            assert f[-10:].mean() < f[:10].mean(), f"{kind} {t} did not learn"
    # different learning rates gave different trajectories: they really are per tenant
    assert fused.slot("t0").optimizer.param_groups[0]["lr"] != fused.slot("t1").optimizer.param_groups[0]["lr"]


def test_fused_rl_objective_equals_the_loop(backbone):
    fused, loop = runners(backbone, "gaussian")
    data = batches(7)
    reqs = []
    for t, (obs, act) in data.items():
        b = obs.batch_size
        g = torch.Generator().manual_seed(b)
        loss = PolicyLoss(torch.randn(b, generator=g) - 20, torch.randn(b, generator=g), torch.randn(b, generator=g))
        reqs.append(ForwardBackward(t, obs, act, loss=loss))
    a = fused.run_heads(reqs, _features(fused, reqs), fuse=True)
    b = loop.run_heads(reqs, _features(loop, reqs), fuse=False)
    for x, y in zip(a, b):
        assert x.ok and y.ok, (x.error, y.error)
        for k in ("loss", "policy_loss", "value_loss", "approx_kl"):
            assert abs(x.output[k] - y.output[k]) <= TOL, k
        assert (x.output["log_prob"] - y.output["log_prob"]).abs().max() <= 1e-4
    for t in fused.slots:
        for pf, pl in zip(fused.slot(t).params, loop.slot(t).params):
            if pf.grad is not None:
                assert close(pf.grad, pl.grad)


def test_a_fused_step_leaves_other_tenants_byte_identical(backbone):
    fused, _ = runners(backbone, "gaussian")
    data = batches(3)
    before = {t: snapshot(fused.slot(t)) for t in fused.slots}
    # t0 trains while the others sample in the same fused bucket... and in a training bucket of their own
    reqs = [ForwardBackward("t0", *data["t0"])] + [Sample(t, data[t][0], True) for t in fused.slots if t != "t0"]
    assert all(r.ok for r in fused.execute(reqs))
    fused.optim_step("t0").unwrap()
    for t in fused.slots:
        if t == "t0":
            assert not same_bytes(before[t], snapshot(fused.slot(t)))
        else:
            assert same_bytes(before[t], snapshot(fused.slot(t))), t
            assert fused.slot(t).version == 0 and fused.slot(t).accumulated == 0


def test_one_tenants_nan_fails_only_that_tenant_in_a_fused_call(backbone):
    fused, loop = runners(backbone, "gaussian")
    with torch.no_grad():
        fused.slot("t2").head.mean_out.weight.fill_(float("nan"))
        loop.slot("t2").head.mean_out.weight.fill_(float("nan"))
    poisoned = snapshot(fused.slot("t2"))
    data = batches(5)
    reqs = [ForwardBackward(t, obs, act) for t, (obs, act) in data.items()]
    a = fused.run_heads(reqs, _features(fused, reqs), fuse=True)
    b = loop.run_heads(reqs, _features(loop, reqs), fuse=False)
    assert isinstance(a[2].error, NonFiniteError) and "t2" in str(a[2].error)
    assert same_bytes(poisoned, snapshot(fused.slot("t2"))) and fused.slot("t2").accumulated == 0
    for i, (x, y) in enumerate(zip(a, b)):
        if i != 2:
            assert x.ok and abs(x.output["loss"] - y.output["loss"]) <= TOL
            for pf, pl in zip(fused.slot(x.tenant).params, loop.slot(x.tenant).params):
                if pf.grad is not None:
                    assert torch.isfinite(pf.grad).all() and close(pf.grad, pl.grad)


def test_a_second_request_of_one_tenant_in_a_call_is_settled_after_the_first(backbone):
    """Two forward_backwards of one tenant in one call: both accumulate, in order, like two calls."""
    fused, loop = runners(backbone, "flow")  # flow's loss draws noise: the order of draws matters
    data = batches(9)
    obs, act = data["t1"]
    reqs = [ForwardBackward("t1", obs, act), ForwardBackward("t0", *data["t0"]), ForwardBackward("t1", obs, act)]
    a = fused.execute(reqs)
    for r in reqs:
        loop.execute([r], grouped=False)
    assert all(r.ok for r in a) and fused.slot("t1").accumulated == 2
    for pf, pl in zip(fused.slot("t1").params, loop.slot("t1").params):
        if pf.grad is not None:
            assert close(pf.grad, pl.grad)
    assert torch.equal(fused.slot("t1").generator.get_state(), loop.slot("t1").generator.get_state())


def test_stacked_parameters_follow_each_optimizer_step(backbone):
    """The fused call's cached stack is refreshed when a tenant's weights change (and only then)."""
    fused, loop = runners(backbone, "l1_chunk")
    data = batches(11)
    reqs = [Sample(t, obs, True) for t, (obs, _) in data.items()]
    feats = _features(fused, reqs)
    first = fused.run_heads(reqs, feats, fuse=True)
    train = [ForwardBackward("t3", *data["t3"])]
    for runner in (fused, loop):
        runner.execute(train)
        runner.optim_step("t3").unwrap()
    again = fused.run_heads(reqs, feats, fuse=True)
    ref = loop.run_heads(reqs, feats, fuse=False)
    assert diff(again[3].output, first[3].output) > 1e-4  # t3 moved ...
    for x, y in zip(again, ref):
        assert diff(x.output, y.output) <= TOL  # ... and the fused call serves its new weights


def test_the_stack_cache_never_serves_a_removed_tenants_weights(backbone):
    """A slot that leaves and a new one of the same architecture (possibly at a reused id) get a
    fresh stack: the new tenant is served its own weights."""
    fused, loop = runners(backbone, "l1_chunk")
    reqs = [Sample(t, obs, True) for t, (obs, _) in batches(13).items()]
    feats = _features(fused, reqs)
    fused.run_heads(reqs, feats, fuse=True)
    for r in (fused, loop):
        r.remove_slot("t2")
        r.create_slot("t2", spec("l1_chunk"), OptimizerSpec(lr=1e-3), seed=999)  # other weights
    for x, y in zip(fused.run_heads(reqs, feats, fuse=True), loop.run_heads(reqs, feats, fuse=False)):
        assert diff(x.output, y.output) <= TOL, x.tenant


def test_a_failed_fused_call_falls_back_to_each_tenant_alone(backbone, monkeypatch):
    """Two requests of one tenant in the bucket: the fallback rewinds its generator to the first."""
    fused, loop = runners(backbone, "gaussian")
    data = batches(17)
    reqs = [Sample("t0", data["t0"][0]), Sample("t1", data["t1"][0]), Sample("t0", data["t0"][0])]

    def broken(*a, **k):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(fused.fused, "sample", broken)
    a = fused.execute(reqs)
    b = loop.execute(reqs, grouped=False)
    for x, y in zip(a, b):
        assert x.ok and diff(x.output, y.output) <= TOL
    for t in ("t0", "t1"):
        assert torch.equal(fused.slot(t).generator.get_state(), loop.slot(t).generator.get_state())
