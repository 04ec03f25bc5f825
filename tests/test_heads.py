"""Action heads: output contracts, learning, head-specific maths, layer-wise features and spec validation."""

import pytest
import torch

from conftest import TENANTS
from vlamux.model import (HEADS, ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, Sample, Slot, build_head,
                          canonicalize)
from vlamux.model.heads.bins import BinsHead
from vlamux.model.heads.gaussian import GaussianHead
from vlamux.model.synthetic import make_batch

TOL = 1e-5
SPECS = {spec.kind: (spec, profile) for spec, profile in TENANTS.values()}  # one tenant per head kind


def test_every_head_kind_is_covered():
    assert set(SPECS) == set(HEADS)


def features(backbone, profile, batch=3, seed=0, n_layers=0):
    obs, actions = make_batch(profile, batch, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        f = backbone(canonicalize(obs, backbone.schema, backbone.tokenizer), n_layers=n_layers)
    return f, obs, actions


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_loss_and_sample_contract(backbone, kind):
    spec, profile = SPECS[kind]
    torch.manual_seed(0)
    head = build_head(spec, backbone.meta.hidden_dim)
    assert isinstance(head, HEADS[kind]) and head.kind == kind
    f, obs, actions = features(backbone, profile)
    b, h, a = 3, spec.horizon, spec.action_dim
    state = obs.state if spec.state_dim else None
    g = torch.Generator().manual_seed(0)
    loss, metrics = head.loss(f, state, actions, torch.ones(b, h, dtype=torch.bool), g)
    assert loss.dim() == 0 and torch.isfinite(loss) and loss.requires_grad
    # 0-d tensors, detached: the caller reads them once per group (a read waits for the device)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    for deterministic in (True, False):
        with torch.no_grad():
            out = head.sample(f, state, g, deterministic)
        assert out["actions"].shape == (b, h, a) and torch.isfinite(out["actions"]).all()
        if kind in ("gaussian", "bins"):
            assert out["log_prob"].shape == (b,) and torch.isfinite(out["log_prob"]).all()
            assert out["value"].shape == (b,) and torch.isfinite(out["value"]).all()


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_head_overfits_one_batch(backbone, kind):
    spec, profile = SPECS[kind]
    f, obs, actions = features(backbone, profile, batch=4)
    slot = Slot(kind, spec, backbone.meta, OptimizerSpec(lr=1e-3), seed=1)
    losses = []
    for _ in range(60):
        losses.append(slot.forward_backward(f, obs.state, actions)["loss"])
        slot.optim_step()
    losses = torch.tensor(losses)
    assert torch.isfinite(losses).all()
    if kind == "flow":
        # The flow-matching loss draws fresh noise and flow times each step, so single losses are noisy (one
        # unlucky t near 0 or 1 can double it); compare the first five and last five steps, with some slack.
        assert losses[-5:].mean() < 0.6 * losses[:5].mean(), losses
    else:
        assert losses[-1] < 0.5 * losses[0], losses


# ---- bins ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_bins", [2, 32, 256])
def test_bins_round_trip_and_clamp(n_bins):
    head = build_head(HeadSpec("bins", 3, 2, options={"n_bins": n_bins}), 16)
    assert isinstance(head, BinsHead)
    x = torch.linspace(-1, 1, 1001)
    idx = head.to_bins(x)
    assert idx.dtype == torch.long and idx.min() >= 0 and idx.max() <= n_bins - 1
    assert idx[0] == 0 and idx[-1] == n_bins - 1
    assert (head.from_bins(idx) - x).abs().max() <= 1.0 / n_bins + 1e-6
    assert (idx[1:] >= idx[:-1]).all()  # monotone
    outside = torch.tensor([-7.0, -1.0001, 1.0001, 3.0, float("inf"), -float("inf")])
    assert head.to_bins(outside).tolist() == [0, 0, n_bins - 1, n_bins - 1, n_bins - 1, 0]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_bins_temperature_tempers_sampling_only(backbone, temperature):
    spec, profile = SPECS["bins"]
    f, obs, actions = features(backbone, profile, batch=4)
    state = obs.state if spec.state_dim else None
    torch.manual_seed(0)
    plain = build_head(spec, backbone.meta.hidden_dim)
    tempered = build_head(HeadSpec(**{**spec.__dict__, "options": {**spec.options, "temperature": temperature}}),
                          backbone.meta.hidden_dim)
    tempered.load_state_dict(plain.state_dict())
    mask = torch.ones(4, spec.horizon, dtype=torch.bool)
    with torch.no_grad():
        # SFT's loss and the deterministic (served) policy do not depend on it
        assert torch.equal(plain.loss(f, state, actions, mask)[0], tempered.loss(f, state, actions, mask)[0])
        assert torch.equal(plain.sample(f, state, deterministic=True)["actions"],
                           tempered.sample(f, state, deterministic=True)["actions"])
        out = tempered.sample(f, state, generator=torch.Generator().manual_seed(1))
        # the sampled chunk's log-probability is that of softmax(logits / T), computed apart
        logits, _ = plain.logits(f, state)
        chosen = torch.log_softmax(logits / temperature, -1).gather(-1, out["bins"][..., None])
        expect = chosen.squeeze(-1).sum((-1, -2))
        assert torch.allclose(out["log_prob"], expect, atol=TOL)
        lp, ent, _ = tempered.evaluate(f, state, out["actions"], mask)
        assert torch.allclose(lp, expect, atol=TOL)
        p = torch.softmax(logits / temperature, -1)
        assert torch.allclose(ent, -(p * p.log()).sum((-1, -2, -3)), atol=1e-4)
        # and it is not the untempered distribution's
        assert not torch.allclose(plain.evaluate(f, state, out["actions"], mask)[0], expect, atol=1e-3)


def test_bins_rejects_too_few_bins():
    with pytest.raises(ValueError, match="n_bins"):
        build_head(HeadSpec("bins", 3, 2, options={"n_bins": 1}), 16)


# ---- gaussian -----------------------------------------------------------------------------------

def test_gaussian_log_prob_and_entropy_match_torch():
    g = torch.Generator().manual_seed(0)
    b, h, a = 5, 4, 3
    mean = torch.randn(b, h, a, generator=g)
    log_std = torch.randn(b, h, a, generator=g) * 0.5
    actions = torch.randn(b, h, a, generator=g)
    full = torch.ones(b, h, dtype=torch.bool)
    dist = torch.distributions.Normal(mean, log_std.exp())
    assert (GaussianHead.log_prob(mean, log_std, actions, full) - dist.log_prob(actions).sum((1, 2))).abs().max() <= TOL
    assert (GaussianHead.entropy(log_std, full) - dist.entropy().sum((1, 2))).abs().max() <= TOL
    mask = torch.rand(b, h, generator=g) > 0.4
    m = mask[..., None].float()
    assert (GaussianHead.log_prob(mean, log_std, actions, mask)
            - (dist.log_prob(actions) * m).sum((1, 2))).abs().max() <= TOL
    assert (GaussianHead.entropy(log_std, mask) - (dist.entropy() * m).sum((1, 2))).abs().max() <= TOL


def test_gaussian_sample_log_prob_is_of_its_own_actions(backbone):
    spec, profile = SPECS["gaussian"]
    torch.manual_seed(0)
    head = build_head(spec, backbone.meta.hidden_dim)
    f, obs, _ = features(backbone, profile)
    with torch.no_grad():
        out = head.sample(f, obs.state, torch.Generator().manual_seed(3))
        mean, log_std, value = head.distribution(f, obs.state)
    dist = torch.distributions.Normal(mean, log_std.exp())
    assert (out["log_prob"] - dist.log_prob(out["actions"]).sum((1, 2))).abs().max() <= 1e-4
    assert torch.allclose(out["value"], value)


# ---- flow ---------------------------------------------------------------------------------------

def test_flow_sampling_is_reproducible(backbone):
    spec, profile = SPECS["flow"]
    torch.manual_seed(0)
    head = build_head(spec, backbone.meta.hidden_dim)
    f, _, _ = features(backbone, profile)
    with torch.no_grad():
        a = head.sample(f, None, torch.Generator().manual_seed(5))["actions"]
        b = head.sample(f, None, torch.Generator().manual_seed(5))["actions"]
        c = head.sample(f, None, torch.Generator().manual_seed(6))["actions"]
        d1 = head.sample(f, None, torch.Generator().manual_seed(1), deterministic=True)["actions"]
        d2 = head.sample(f, None, torch.Generator().manual_seed(2), deterministic=True)["actions"]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(d1, d2)


# ---- layer-wise features ------------------------------------------------------------------------

def wake(slot):
    """The flow head's adaLN-zero gates start at zero, so an untrained flow head ignores the features
    entirely; give the modulation layers small seeded weights so the features matter (no-op for other heads)."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in slot.head.named_parameters():
            if ".modulation." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return slot


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_feature_layers_equal_to_depth(backbone, kind):
    spec, profile = SPECS[kind]
    layered = HeadSpec(spec.kind, spec.action_dim, spec.horizon, spec.state_dim, depth=2, feature_layers=2,
                       options=spec.options)
    final = HeadSpec(spec.kind, spec.action_dim, spec.horizon, spec.state_dim, depth=2, options=spec.options)
    # a deeper layer-wise head shares the group: the runner must run the backbone for the most layers asked
    deep = HeadSpec(spec.kind, spec.action_dim, spec.horizon, spec.state_dim, depth=4, feature_layers=4,
                    options=spec.options)
    runner = ModelRunner(backbone)
    for name, s in (("layered", layered), ("final", final), ("deep", deep)):
        wake(runner.create_slot(name, s, seed=7))
    obs, actions = make_batch(profile, 2, torch.Generator().manual_seed(0))
    res = runner.execute([Sample("layered", obs, True), Sample("final", obs, True), Sample("deep", obs, True),
                          ForwardBackward("layered", obs, actions)])
    assert all(r.ok for r in res), [r.error for r in res]
    assert res[0].group_size == 4
    # same weights (same seed, same architecture), different memories: the layers were really read
    # (a bins head's actions are bin centres, so its continuous output is the log-probability)
    key = "log_prob" if kind == "bins" else "actions"
    assert (res[0].output[key] - res[1].output[key]).abs().max() > 1e-4
    alone = ModelRunner(backbone)
    wake(alone.create_slot("layered", layered, seed=7))
    solo = alone.execute([Sample("layered", obs, True)])[0]
    assert solo.ok and (solo.output["actions"] - res[0].output["actions"]).abs().max() <= TOL
    assert res[3].output["loss"] > 0 and runner.slot("layered").accumulated == 1
    # what the runner gave the head is the backbone's last two layers
    canon = canonicalize(obs, backbone.schema, backbone.tokenizer)
    with torch.no_grad():
        direct = alone.slot("layered").sample(backbone(canon, n_layers=2), obs.state, deterministic=True)
    assert (direct["actions"] - res[0].output["actions"]).abs().max() <= TOL


def test_layerwise_head_rejects_feature_without_layers(backbone):
    spec, profile = SPECS["l1_chunk"]
    slot = Slot("t", HeadSpec(spec.kind, spec.action_dim, spec.horizon, spec.state_dim, depth=2, feature_layers=2),
                backbone.meta)
    f, obs, _ = features(backbone, profile, n_layers=0)
    with pytest.raises(Exception, match="layer"):
        slot.sample(f, obs.state, deterministic=True)


@pytest.mark.parametrize("feature_layers", [1, 3])
def test_feature_layers_other_than_zero_or_depth_rejected(feature_layers):
    with pytest.raises(ValueError, match="feature_layers"):
        build_head(HeadSpec("l1_chunk", 2, 4, depth=2, feature_layers=feature_layers), 16)


# ---- spec validation ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(HEADS))
def test_unknown_option_rejected(kind):
    with pytest.raises(ValueError, match="bogus"):
        build_head(HeadSpec(kind, 2, 4, options={"bogus": 1}), 16)


def test_spec_field_validation():
    with pytest.raises(ValueError, match="n_heads"):
        HeadSpec("l1_chunk", 2, 4, width=130, n_heads=4)
    for field, bad in (("action_dim", 0), ("horizon", -1), ("width", 0), ("depth", 0)):
        with pytest.raises(ValueError, match=field):
            HeadSpec(**{"kind": "l1_chunk", "action_dim": 2, "horizon": 4, field: bad})
    with pytest.raises(ValueError, match="state_dim"):
        HeadSpec("l1_chunk", 2, 4, state_dim=-1)
    with pytest.raises(ValueError, match="'nope'"):
        build_head(HeadSpec("nope", 2, 4), 16)


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_spec_json_round_trip(kind):
    spec = SPECS[kind][0]
    again = HeadSpec.from_json(spec.to_json())
    assert again == spec and again.to_json() == spec.to_json()
    custom = HeadSpec(kind, 7, 3, state_dim=5, width=64, depth=3, n_heads=8, feature_layers=3,
                      options=dict(HEADS[kind].DEFAULT_OPTIONS))
    assert HeadSpec.from_json(custom.to_json()) == custom
