"""RL for flow heads (Flow-SDE): the chain's log-probability against the step Gaussians computed apart,
the SDE at noise level zero against the deterministic sampler, grouped against serial over 20 PPO
updates, and isolation (fp32, <= 1e-5)."""

import math

import pytest
import torch
from torch.distributions import Normal

from conftest import same_bytes, snapshot
from vlamux.envs import EnvSpec
from vlamux.errors import InvalidInputError
from vlamux.jobs import JobSpecError, load_spec
from vlamux.model import ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, PolicyLoss, Sample, canonicalize
from vlamux.model.heads.flow_sde import RL_SAMPLED, FlowExploration
from vlamux.model.synthetic import TaskProfile, make_batch
from vlamux.workflows.rl import RLConfig, RLRun

TOL = 1e-5
PROFILE = TaskProfile({"top": (32, 32)}, 4, 6, 3, "reach the {color} block")
TENANTS = ("t0", "t1", "t2")


def spec(steps: int = 4, critic: bool = True) -> HeadSpec:
    return HeadSpec("flow", action_dim=4, horizon=6, state_dim=3, width=32, depth=1,
                    options={"steps": steps, "critic": critic})


def head_inputs(backbone, slot, obs):
    with torch.no_grad():
        feature = backbone.forward_group([canonicalize(obs, backbone.schema, backbone.tokenizer)])[0]
    return slot.sample_inputs(feature, slot.check_rows(obs.batch_size, obs.state))


def step_gaussians_log_prob(head, feature, state, chain, noise_level, stochastic):
    """The chain's log-probability [B, H], written apart from vlamux.model.heads.flow_sde: each
    stochastic step a torch Normal around the SDE's Euler-Maruyama mean."""
    k_steps = chain.shape[1] - 1
    dt = 1.0 / k_steps
    total = torch.zeros(chain.shape[0], chain.shape[2])
    for k in range(k_steps):
        t = k * dt
        t_sigma = max(t, dt)
        sigma = noise_level * math.sqrt((1 - t_sigma) / t_sigma)
        x = chain[:, k]
        v = head.velocity(feature, state, x, torch.full((x.shape[0],), t)).float()
        predicted_noise = x - t * v
        drift = v - sigma ** 2 * predicted_noise / (2 * (1 - t))
        mean = x + drift * dt
        lp = Normal(mean, sigma * math.sqrt(dt)).log_prob(chain[:, k + 1]).sum(-1)  # [B, H]
        total = total + lp * stochastic[:, k, None]
    return total


@pytest.mark.parametrize("steps_trained", [0, 2])
def test_a_sampled_chains_log_prob_equals_the_step_gaussians(backbone, steps_trained):
    runner = ModelRunner(backbone)
    slot = runner.create_slot("t0", spec(), OptimizerSpec(), seed=3)
    obs, _ = make_batch(PROFILE, 5, torch.Generator().manual_seed(0))
    feature, state = head_inputs(backbone, slot, obs)
    explore = FlowExploration(noise_level=0.7, steps_trained=steps_trained)
    head = slot.head
    with torch.no_grad():
        draws = head.draw("sample", 5, torch.Generator().manual_seed(1), explore=explore)
        out = head.sample(feature, state, noise=draws)
        stochastic = torch.zeros(5, head.steps).scatter_(1, out["chain_steps"], 1.0)
        assert int(stochastic.sum(1).unique()) == (steps_trained or head.steps)
        want = step_gaussians_log_prob(head, feature, state, out["chain"], 0.7, stochastic)
        assert torch.equal(out["chain"][:, -1], out["actions"])
        assert (out["step_log_prob"] - want).abs().max() <= TOL * max(1.0, want.abs().max().item())
        mask = torch.ones(5, 6, dtype=torch.bool)
        mask[:, 4:] = False  # the executed steps only
        sampled = {k: out[k] for k in RL_SAMPLED}
        log_prob, entropy, value = head.evaluate(feature, state, out["actions"], mask, sampled=sampled)
    scored = (want * mask).sum(-1)
    assert (log_prob - scored).abs().max() <= TOL * max(1.0, scored.abs().max().item())
    assert value.shape == (5,) and entropy.shape == (5,) and torch.isfinite(entropy).all()


def test_at_noise_level_zero_the_sde_is_the_deterministic_sampler(backbone):
    runner = ModelRunner(backbone)
    slot = runner.create_slot("t0", spec(steps=5), OptimizerSpec(), seed=4)
    obs, _ = make_batch(PROFILE, 3, torch.Generator().manual_seed(2))
    feature, state = head_inputs(backbone, slot, obs)
    head = slot.head
    with torch.no_grad():
        draws = head.draw("sample", 3, torch.Generator().manual_seed(5), explore=FlowExploration(0.0))
        assert not draws["std"].any()
        sde = head.sample(feature, state, noise=draws)["actions"]
        ode = head.sample(feature, state, noise={"x0": draws["x0"]})["actions"]
        assert torch.equal(sde, ode)
        draws["x0"] = torch.zeros_like(draws["x0"])  # the deterministic sampler starts from zeros
        assert torch.equal(head.sample(feature, state, noise=draws)["actions"],
                           head.sample(feature, state, deterministic=True)["actions"])


def _runners(backbone):
    made = []
    for fuse in (True, False):
        r = ModelRunner(backbone, fuse_heads=fuse)
        for i, t in enumerate(TENANTS):
            # Adam's eps above fp32's noise: at the default 1e-8 an element whose gradient is itself of that
            # size (t0's instruction projection here) moves by lr x g / (|g| + eps), so one ulp of summation
            # order between the fused and the one-by-one gradient became a 1.2e-5 step on one CPU of two
            r.create_slot(t, spec(), OptimizerSpec(lr=[1e-3, 3e-4, 2e-3][i], eps=1e-6), seed=20 + i)
        made.append(r)
    return made


def _rl_requests(samples: dict, data: dict, gen: torch.Generator) -> list[ForwardBackward]:
    reqs = []
    for t, out in samples.items():
        obs, _ = data[t]
        b = obs.batch_size
        mask = torch.zeros(b, 6, dtype=torch.bool)
        mask[:, :4] = True
        loss = PolicyLoss(out["step_log_prob"][:, :4].sum(-1), torch.randn(b, generator=gen),
                          torch.randn(b, generator=gen), sampled={k: out[k] for k in RL_SAMPLED})
        reqs.append(ForwardBackward(t, obs, out["actions"], mask, loss=loss))
    return reqs


def test_grouped_flow_ppo_equals_serial_over_20_updates(backbone):
    """Three flow tenants (their own learning rates and batch sizes): 20 updates of sample with
    exploration, then a PPO forward_backward on that sample and an optimizer step; grouped (one
    backbone forward, fused heads) against each request alone (unfused): samples, losses and every
    parameter within 1e-5."""
    grouped, serial = _runners(backbone)
    explore = FlowExploration(noise_level=0.5, steps_trained=2)
    losses = {"grouped": [], "serial": []}
    for update in range(20):
        g = torch.Generator().manual_seed(100 + update)
        data = {t: make_batch(PROFILE, 2 + i, g) for i, t in enumerate(TENANTS)}
        samples = [Sample(t, obs, explore=explore) for t, (obs, _) in data.items()]
        got = grouped.execute(samples)
        alone = [serial.execute([r])[0] for r in samples]
        for a, b in zip(got, alone):
            assert a.ok and b.ok, (a.error, b.error)
            for k in ("actions", "chain", "chain_std", "step_log_prob", "value"):
                assert (a.output[k] - b.output[k]).abs().max() <= TOL, (update, a.tenant, k)
            assert torch.equal(a.output["chain_steps"], b.output["chain_steps"])
        # both train on the one sample, so that the comparison is of the update alone
        outs = {r.tenant: r.output for r in alone}
        for name, runner, one_by_one in (("grouped", grouped, False), ("serial", serial, True)):
            reqs = _rl_requests(outs, data, torch.Generator().manual_seed(update))
            results = [runner.execute([r])[0] for r in reqs] if one_by_one else runner.execute(reqs)
            losses[name].append([r.unwrap()["loss"] for r in results])
            for t in TENANTS:
                runner.optim_step(t).unwrap()
    assert grouped.fused.calls > 0  # the grouped runner really fused the heads
    a, b = torch.tensor(losses["grouped"]), torch.tensor(losses["serial"])
    assert (a - b).abs().max() <= TOL, (a - b).abs().max()
    for t in TENANTS:
        for pa, pb in zip(grouped.slot(t).params, serial.slot(t).params):
            assert (pa - pb).abs().max() <= TOL * max(1.0, pb.abs().max().item()), t
        assert grouped.slot(t).version == serial.slot(t).version == 20


def test_a_flow_rl_update_leaves_every_neighbour_byte_identical(backbone):
    grouped, _ = _runners(backbone)
    g = torch.Generator().manual_seed(9)
    data = {t: make_batch(PROFILE, 2, g) for t in TENANTS}
    out = grouped.execute([Sample("t0", data["t0"][0], explore=FlowExploration(0.5))])[0].unwrap()
    before = {t: snapshot(grouped.slot(t)) for t in TENANTS}
    reqs = _rl_requests({"t0": out}, data, g) + [Sample(t, data[t][0], True) for t in TENANTS[1:]]
    assert all(r.ok for r in grouped.execute(reqs))
    grouped.optim_step("t0").unwrap()
    assert not same_bytes(before["t0"], snapshot(grouped.slot("t0")))
    for t in TENANTS[1:]:
        assert same_bytes(before[t], snapshot(grouped.slot(t))), t


def test_bad_chains_and_exploration_are_refused_by_name(backbone):
    runner = ModelRunner(backbone)
    runner.create_slot("flow", spec(), OptimizerSpec(), seed=1)
    runner.create_slot("gauss", HeadSpec("gaussian", action_dim=4, horizon=6, state_dim=3, width=32, depth=1),
                       OptimizerSpec(), seed=2)
    obs, _ = make_batch(PROFILE, 2, torch.Generator().manual_seed(0))
    out = runner.execute([Sample("flow", obs, explore=FlowExploration(0.5))])[0].unwrap()
    ok = {k: out[k] for k in RL_SAMPLED}

    def fb(tenant, **changed):
        sampled = {**ok, **changed}
        loss = PolicyLoss(torch.zeros(2), torch.ones(2), sampled=sampled)
        return runner.execute([ForwardBackward(tenant, obs, out["actions"], loss=loss)])[0]

    assert fb("flow").ok
    with pytest.raises(InvalidInputError, match="chain_steps: each must index a step"):
        fb("flow", chain_steps=ok["chain_steps"] + 4).unwrap()
    with pytest.raises(InvalidInputError, match="chain_std: every stochastic step's std must be > 0"):
        fb("flow", chain_std=torch.zeros_like(ok["chain_std"])).unwrap()
    with pytest.raises(InvalidInputError, match=r"samples chains of \[B, 5, 6, 4\]"):
        fb("flow", chain=ok["chain"][:, :, :3]).unwrap()
    with pytest.raises(InvalidInputError, match="a denoising chain is for a flow head"):
        fb("gauss").unwrap()
    with pytest.raises(InvalidInputError, match="flow exploration is for flow heads"):
        runner.execute([Sample("gauss", obs, explore=FlowExploration(0.5))])[0].unwrap()
    with pytest.raises(InvalidInputError, match="scores the denoising chain its rollout sampled"):
        runner.execute([ForwardBackward("flow", obs, out["actions"], loss=PolicyLoss(torch.zeros(2),
                                                                                       torch.ones(2)))])[0].unwrap()
    with pytest.raises(InvalidInputError, match="noise_level: must be a number in"):
        FlowExploration(noise_level=-0.1)


# ---- through the services: the RL workflow and job specs -------------------------------------------------
ENV = EnvSpec(task="goal/touch-red-cube", image_size=16, max_steps=12, n_action_steps=2)
FLOW = {"kind": "flow", "action_dim": 4, "horizon": 4, "state_dim": 8, "width": 32, "depth": 1,
        "options": {"steps": 3}}


@pytest.mark.parametrize("algorithm,mode,critic", [("ppo", "async", True), ("grpo", "sync", False)])
def test_flow_rl_runs_on_the_pipeline(runtime, algorithm, mode, critic):
    """A flow tenant's RL through the Inference and Training Queues: its rollouts sample chains with
    exploration, its updates score them; PPO with the head's critic, GRPO without one."""
    tenant = f"flow-{algorithm}"
    spec = HeadSpec(**{**FLOW, "options": {"steps": 3, "critic": critic}})
    runtime.create_slot(tenant, spec, OptimizerSpec(lr=1e-4)).result(30)
    assert runtime.publisher.flush(10)
    before = runtime.training.version(tenant)
    cfg = RLConfig(env=ENV, algorithm=algorithm, mode=mode, env_steps=48, n_envs=4, group_size=2, sub_batches=1,
                   segment_steps=6, minibatch_rows=8, flow=FlowExploration(0.5, steps_trained=1))
    stats = RLRun(runtime, tenant, cfg).run()
    assert stats.env_steps >= 48
    assert stats.segments_trained + stats.segments_dropped >= 1
    if algorithm == "ppo":
        assert stats.segments_trained >= 1 and runtime.training.version(tenant) > before
        assert all(math.isfinite(x) for x in stats.losses + stats.approx_kl)
    assert runtime.environment.list_sessions(tenant) == []


def test_flow_rl_job_specs_are_checked_at_submission():
    base = {"name": "f", "tenant": "t", "kind": "rl", "rl": {"env": {"task": ENV.task}}}
    spec = load_spec({**base, "head": {**FLOW, "options": {"critic": True}}})
    assert spec.rl.flow == FlowExploration()  # the defaults, for a flow head
    spec = load_spec({**base, "head": FLOW, "rl": {**base["rl"], "algorithm": "grpo",
                                                   "flow": {"noise_level": 0.3, "steps_trained": 2}}})
    assert spec.rl.flow == FlowExploration(0.3, 2)
    with pytest.raises(JobSpecError, match="PPO trains a critic, and this flow head has none"):
        load_spec({**base, "head": FLOW})
    with pytest.raises(JobSpecError, match="rl.flow.noise_level: .* must be > 0"):
        load_spec({**base, "head": FLOW, "rl": {**base["rl"], "algorithm": "grpo", "flow": {"noise_level": 0}}})
    with pytest.raises(JobSpecError, match=r"rl.flow.noise_level: must be a number in \[0, 2\]"):
        load_spec({**base, "head": FLOW, "rl": {**base["rl"], "flow": {"noise_level": 3}}})
    with pytest.raises(JobSpecError, match="rl.flow.mode: .*'sde'"):  # Flow-Noise is not built
        load_spec({**base, "head": FLOW, "rl": {**base["rl"], "algorithm": "grpo", "flow": {"mode": "noise"}}})
    imported = {**base, "init_from": str(FIX_DIR / "pi0"), "rl": {**base["rl"], "algorithm": "grpo"}}
    assert load_spec(imported).rl.flow == FlowExploration()  # an imported expert reinforced by GRPO
    with pytest.raises(JobSpecError, match="an imported expert has none; use algorithm grpo"):
        load_spec({**imported, "rl": base["rl"]})
    with pytest.raises(JobSpecError, match="rl.flow: for a flow head or an imported expert; this head is 'gaussian'"):
        load_spec({**base, "head": {**FLOW, "kind": "gaussian", "options": {}}, "rl": {**base["rl"], "flow": {}}})


# ---- imported experts (lerobot's convention: the noise at t = 1, the actions at t = 0) ---------------------
@pytest.mark.parametrize("family", ["smolvla", "pi0", "pi05"])
def test_an_imported_experts_chain_is_scored_in_lerobots_own_times(family, tmp_path):
    """An imported expert explores by the same SDE, its times mapped from lerobot's: at noise level 0
    from lerobot's reference noise it gives lerobot's reference actions; the update's log-prob of a
    sampled chain equals the step Gaussians written in lerobot's variables (s = 1 - t, u = noise -
    actions); a GRPO update on the chain changes the tenant and not its neighbour."""
    from test_vla_tenants import observation, other_expert, reference, runner_for

    ref, meta = reference(family)
    runner = runner_for(family)
    runner.import_lerobot("a", FIX_DIR / family)
    runner.import_lerobot("b", other_expert(tmp_path, family))
    obs = observation(ref, meta, "batch0")
    b = obs.batch_size
    [r] = runner.execute([Sample("a", obs, noise=ref["batch0.noise"], explore=FlowExploration(0.0))])
    assert (r.unwrap()["actions"] - ref["batch0.action"]).abs().max() <= 1e-4

    level, head = 0.6, runner.slot("a").head
    out = runner.execute([Sample("a", obs, explore=FlowExploration(level))])[0].unwrap()
    chain, dims, k_steps = out["chain"], head.spec.action_dim, head.steps
    assert chain.shape[1:] == head.chain_shape() and (out["chain_steps"] == torch.arange(k_steps)).all()
    # the step Gaussians apart, in lerobot's variables, with the expert's velocity on the update's own prefix
    # (its keys and values, caught on their way in): the update's log-prob must equal their sum
    captured = {}
    real = head.expert.velocity

    def spy(kv, x, t, st):
        captured.update(kv=kv, st=st)
        return real(kv, x, t, st)

    head.expert.velocity = spy
    try:
        loss = PolicyLoss(out["step_log_prob"][:, :4].sum(-1), torch.ones(b), sampled={k: out[k] for k in RL_SAMPLED})
        mask = torch.zeros(b, chain.shape[2], dtype=torch.bool)
        mask[:, :4] = True
        [fb] = runner.execute([ForwardBackward("a", obs, out["actions"], mask, loss=loss)])
    finally:
        head.expert.velocity = real
    with torch.no_grad():
        want = torch.zeros(b, chain.shape[2])
        for k in range(k_steps):
            s = 1.0 - k / k_steps  # lerobot's time of this step
            s_sigma = min(s, 1.0 - 1.0 / k_steps)
            sigma = level * math.sqrt(s_sigma / (1.0 - s_sigma))
            x = chain[:, k]
            u = real(captured["kv"], x, torch.full((b,), s), captured["st"]).float()
            predicted_noise = x + (1.0 - s) * u
            mean = x - u / k_steps - sigma ** 2 / (2 * k_steps) * predicted_noise / s
            lp = Normal(mean, sigma * math.sqrt(1.0 / k_steps)).log_prob(chain[:, k + 1])
            want = want + lp[..., :dims].sum(-1)
    got = fb.unwrap()["log_prob"]
    scored = want[:, :4].sum(-1)
    assert (got - scored).abs().max() <= 1e-4 * max(1.0, scored.abs().max().item()), (got, scored)
    assert (out["step_log_prob"][:, :4].sum(-1) - scored).abs().max() <= 1e-4 * max(1.0, scored.abs().max().item())

    before_a = {k: v.clone() for k, v in runner.slot("a").policy_tensors().items()}
    before_b = {k: v.clone() for k, v in runner.slot("b").policy_tensors().items()}
    runner.optim_step("a").unwrap()
    assert any(not torch.equal(before_a[k], v) for k, v in runner.slot("a").policy_tensors().items())
    assert all(torch.equal(before_b[k], v) for k, v in runner.slot("b").policy_tensors().items())


FIX_DIR = __import__("pathlib").Path(__file__).parent / "fixtures" / "lerobot_vla"
