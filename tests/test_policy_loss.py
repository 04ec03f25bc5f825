"""The RL objective (decoupled PPO) in the model core: its value, its corrections, isolation, grouping."""

import pytest
import torch

from conftest import TENANTS, make_runner, snapshot, same_bytes, tenant_batches
from vlamux.errors import InvalidInputError
from vlamux.model import ForwardBackward, PolicyLoss, Sample, policy_objective

RL = {t: TENANTS[t] for t in ("cobalt", "delta")}  # gaussian and bins


def rollout(runner, data):
    """Sample chunks and keep what an RL learner stores: actions and behaviour log-probs."""
    out = {}
    for r in runner.execute([Sample(t, obs) for t, (obs, _) in data.items()]):
        o = r.unwrap()
        out[r.tenant] = (o["actions"], o["step_log_prob"].sum(-1), o["value"])
    return out


def test_fresh_data_is_plain_ppo_and_stale_data_is_reweighted():
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ent, adv = torch.zeros(3), torch.tensor([1.0, -1.0, 2.0])
    loss, m = policy_objective(lp, ent, None, PolicyLoss(lp.detach(), adv))
    assert loss.item() == pytest.approx(-adv.mean().item()) and m["is_weight"] == 1 and m["clip_frac"] == 0
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(g, -adv / 3)  # the policy gradient: -A * grad log pi, averaged
    # data from a much older policy: its importance weight is truncated, not unbounded
    stale = PolicyLoss(lp.detach() - 5.0, adv, max_is_weight=2.0)
    (g,) = torch.autograd.grad(policy_objective(lp, ent, None, stale)[0], lp)
    assert torch.allclose(g, -2.0 * adv / 3)
    # moved past the trust region around the proximal policy: the clipped side carries no gradient
    prox = lp.detach() - torch.tensor([0.5, 0.5, 0.0])
    (g,) = torch.autograd.grad(policy_objective(lp, ent, None, PolicyLoss(prox, adv, proximal_log_prob=prox))[0], lp)
    assert g[0] == 0 and g[1] != 0 and g[2] != 0  # row 0: ratio e^0.5 > 1.2 with A > 0; row 1: A < 0 keeps it


def test_positive_advantage_makes_the_taken_chunk_more_likely(backbone):
    runner = make_runner(backbone, RL, lr=1e-4)  # an RL-sized step: Adam at 1e-3 overshoots a 32-dim chunk
    data = tenant_batches(batch=4, tenants=RL)
    taken = rollout(runner, data)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])

    def step(t, prox=None):
        loss = PolicyLoss(taken[t][1], adv, proximal_log_prob=prox)
        return runner.execute([ForwardBackward(t, data[t][0], taken[t][0], loss=loss)])[0].unwrap()["log_prob"]

    for t in RL:
        before = step(t)  # an epoch-1 pass: its log-probs are the proximal policy for the next ones
        runner.optim_step(t).unwrap()
        for _ in range(2):
            step(t, before)
            runner.optim_step(t).unwrap()
        change = step(t, before) - before
        assert change[adv > 0].mean() > change[adv < 0].mean() + 0.1, (t, change)


def test_the_value_loss_trains_the_critic_and_leaves_the_policy_alone(backbone):
    """With zero advantages (PPO's critic warm-up) only the value head may change: a fresh critic's
    large errors must not rewrite the decoder an SFT policy acts with."""
    runner = make_runner(backbone, RL)
    data = tenant_batches(batch=4, tenants=RL)
    taken = rollout(runner, data)
    for t in RL:
        head = runner.slot(t).head
        loss = PolicyLoss(taken[t][1], torch.zeros(4), returns=torch.full((4,), 5.0))
        runner.execute([ForwardBackward(t, data[t][0], taken[t][0], loss=loss)])[0].unwrap()
        grads = {n: p.grad for n, p in head.named_parameters() if p.grad is not None}
        assert set(grads) and all(n.startswith("value_head.") for n, g in grads.items() if g.abs().sum() > 0), t
        assert grads["value_head.weight"].abs().sum() > 0


def test_rl_loss_grouped_equals_serial_with_supervised_neighbours(backbone):
    data = tenant_batches(batch=3, seed=4)
    a, b = make_runner(backbone), make_runner(backbone)
    taken = rollout(make_runner(backbone, RL), {t: data[t] for t in RL})
    for step in range(3):
        reqs = []
        for t, (obs, act) in data.items():
            if t in RL:
                loss = PolicyLoss(taken[t][1], torch.tensor([1.0, -0.5, 0.25]), returns=torch.tensor([1.0, 0.0, 0.5]))
                reqs.append(ForwardBackward(t, obs, taken[t][0], loss=loss))
            else:
                reqs.append(ForwardBackward(t, obs, act))
        got = {r.tenant: r.unwrap() for r in a.execute(reqs, grouped=True)}
        want = {r.tenant: r.unwrap() for r in b.execute(reqs, grouped=False)}
        for t in TENANTS:
            assert abs(got[t]["loss"] - want[t]["loss"]) <= 1e-5, (step, t)
            a.optim_step(t).unwrap()
            b.optim_step(t).unwrap()
        assert "value_loss" in got["cobalt"] and torch.allclose(got["delta"]["log_prob"], want["delta"]["log_prob"],
                                                                atol=1e-5)


def test_bad_rl_input_names_the_field_and_changes_nothing(backbone):
    runner = make_runner(backbone)
    data = tenant_batches(batch=2)
    obs, act = data["cobalt"]
    before = snapshot(runner.slot("cobalt"))
    bad = [PolicyLoss(torch.zeros(3), torch.zeros(2)),  # wrong batch
           PolicyLoss(torch.zeros(2), torch.tensor([0.0, float("nan")])),
           PolicyLoss(torch.zeros(2), torch.zeros(2), clip_eps=0.0)]
    for loss, field in zip(bad, ["loss.behaviour_log_prob", "loss.advantages", "loss.clip_eps"]):
        r = runner.execute([ForwardBackward("cobalt", obs, act, loss=loss)])[0]
        assert isinstance(r.error, InvalidInputError) and field in str(r.error), r.error
    assert same_bytes(before, snapshot(runner.slot("cobalt")))
    r = runner.execute([ForwardBackward("acme", *data["acme"], loss=PolicyLoss(torch.zeros(2), torch.zeros(2)))])[0]
    assert isinstance(r.error, InvalidInputError) and "gaussian or bins" in str(r.error)
