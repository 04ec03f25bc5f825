"""Workflows on the embedded runtime: RL (async four lanes and sync), SFT, evaluation, job specs, the
Master Service (checkpoints, metrics file, resume). Small budgets: these check behaviour, not learning."""

import csv
import json
import math

import numpy as np
import pytest
import torch

from conftest import snapshot, same_bytes
from vlamux.envs import EnvSpec
from vlamux.errors import VlamuxError
from vlamux.jobs import JobSpecError, load_spec
from vlamux.jobs.master import MasterService
from vlamux.model import BackboneSpec, HeadSpec, OptimizerSpec
from vlamux.services.queues import InferenceQueueConfig
from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig
from vlamux.workflows.advantages import gae, group_advantages
from vlamux.workflows.evaluate import evaluate, paired, wilson
from vlamux.workflows.rl import RLConfig, RLRun, Sampler, Stats

ENV = EnvSpec(task="goal/touch-red-cube", image_size=16, max_steps=12, n_action_steps=2)
HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8, "width": 32, "depth": 1}


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    from demos import demo_dataset

    root = tmp_path_factory.mktemp("wf") / "demos"
    demo_dataset(root, 2, image_size=16, task=ENV.task)
    return root


def _slot(rt, tenant, kind="gaussian"):
    rt.create_slot(tenant, HeadSpec(**{**HEAD, "kind": kind}), OptimizerSpec(lr=1e-4)).result(30)
    assert rt.publisher.flush(10)


def test_gae_and_group_advantages():
    r = torch.tensor([[0.0], [0.0], [1.0]])
    v = torch.zeros(3, 1)
    done = torch.tensor([[False], [False], [True]])
    adv, ret = gae(r, v, done, torch.tensor([5.0]), gamma=0.5, lam=1.0)
    assert torch.allclose(adv[:, 0], torch.tensor([0.25, 0.5, 1.0]))  # the episode's end cuts the bootstrap
    adv, _ = gae(r, v, torch.zeros(3, 1, dtype=torch.bool), torch.tensor([4.0]), gamma=0.5, lam=1.0)
    assert adv[2, 0] == pytest.approx(3.0)
    a, keep = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert keep.tolist() == [True, True, False, False] and a[0] > 0 > a[1] and a[2] == 0


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_rl_runs_within_budget_with_bounded_staleness(runtime, mode):
    tenant = f"rl-{mode}"
    _slot(runtime, tenant)
    cfg = RLConfig(env=ENV, mode=mode, env_steps=96, n_envs=2, sub_batches=2, segment_steps=4, max_staleness=1,
                   minibatch_rows=4)
    progress = []
    stats = RLRun(runtime, tenant, cfg, on_progress=lambda s: progress.append(s.version)).run()
    assert stats.env_steps >= 96 and stats.segments_trained >= 1
    assert runtime.training.version(tenant) == stats.version
    # async: an update per segment; sync: one per round, on both sub-batches' segments at once
    assert stats.segments_trained == stats.version * (1 if mode == "async" else 2)
    if mode == "sync":
        assert stats.rows_dropped == 0 and max(stats.lags) == 0  # phases: every row is on-policy
    assert progress == sorted(progress) and progress[-1] == stats.version
    assert stats.episodes and all(isinstance(s, bool) for _, s in stats.episodes)
    assert stats.lane_busy_s["sampling"] > 0 and stats.lane_busy_s["inference"] > 0
    assert runtime.environment.list_sessions(tenant) == []  # its sessions were closed


def test_multi_task_rl_gives_each_sub_batch_its_task(runtime):
    tenant = "multi-task"
    _slot(runtime, tenant)
    tasks = ("goal/touch-red-cube", "spatial/touch-left-cube")
    cfg = RLConfig(env=ENV, tasks=tasks, mode="sync", env_steps=96, n_envs=2, sub_batches=2, segment_steps=6,
                   minibatch_rows=8, lr=2e-4)
    assert [cfg.task_of(i) for i in range(4)] == list(tasks) * 2
    lock = __import__("threading").Lock()
    instructions = []
    for i in range(2):
        s = Sampler(runtime, tenant, cfg, i, Stats(), lock)
        try:
            instructions.append(set(s._reset()["instruction"]))
        finally:
            s.close()
    assert len(instructions[0]) == len(instructions[1]) == 1 and instructions[0] != instructions[1]
    stats = RLRun(runtime, tenant, cfg).run()
    assert set(stats.by_task) == set(tasks)  # both tasks' episodes ended, and were told apart
    assert runtime.training.runner.slot(tenant).optim_spec.lr == 2e-4  # the RL phase's own rate
    assert sum(n for _, n in stats.by_task.values()) == len(stats.episodes)
    with pytest.raises(Exception, match="sub_batches: 3 must be a multiple of the number of tasks"):
        RLConfig(env=ENV, tasks=tasks, sub_batches=3)


def test_reward_scale_multiplies_the_rewards_a_segment_records(runtime):
    import threading
    from vlamux.workflows.rollout import Segment

    tenant = "scaled"
    _slot(runtime, tenant)
    rewards = []
    for scale in (1.0, 0.25):
        # the same seed and deterministic actions: the same episode, recorded under two scales
        env = EnvSpec(**{**ENV.__dict__, "options": {"reward": "dense"}})  # a reward every step
        cfg = RLConfig(env=env, n_envs=2, segment_steps=6, deterministic=True, reward_scale=scale)
        s = Sampler(runtime, tenant, cfg, 0, Stats(), threading.Lock())
        try:
            seg = Segment(RLRun(runtime, tenant, cfg)._shape(s), False)
            s.fill(seg, fresh_policy=True)
            rewards.append(seg.reward.clone())
        finally:
            s.close()
    assert rewards[0].abs().sum() > 0, "the episode earned no reward: the test shows nothing"
    torch.testing.assert_close(rewards[1], 0.25 * rewards[0])
    with pytest.raises(VlamuxError, match="reward_scale"):
        RLConfig(env=ENV, reward_scale=0.0)


def test_a_minibatch_across_segments_keeps_each_observation_with_its_action():
    """Rows of several segments, shuffled into one minibatch: the i-th observation is the i-th row's
    (the order the actions and behaviour log-probs are given in), whatever segment it came from."""
    from vlamux.workflows.rl import _observations
    from vlamux.workflows.rollout import Segment, SegmentShape

    shape = SegmentShape(steps=3, n_envs=2, cameras={"agentview": (2, 2)}, state_dim=1, horizon=1, action_dim=1)
    parts, ids = [], []
    for k in range(3):
        seg = Segment(shape, pin=False)
        seg.state.copy_(torch.arange(6, dtype=torch.float32).reshape(3, 2, 1) + 100 * k)  # row id, per segment
        seg.images["agentview"].copy_(seg.state.to(torch.uint8).reshape(3, 2, 1, 1, 1).expand(3, 2, 3, 2, 2))
        seg.instruction = [f"seg{k}-env0", f"seg{k}-env1"]
        rows = torch.tensor([0, 3, 4, 5][: 2 + k])
        parts.append((seg, rows))
        ids += [(100 * k + int(r), f"seg{k}-env{int(r) % 2}") for r in rows]
    idx = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    obs = _observations(parts, idx)
    assert obs.state[:, 0].tolist() == [ids[i][0] for i in idx.tolist()]
    assert obs.instruction == [ids[i][1] for i in idx.tolist()]
    assert obs.images["agentview"][:, 0, 0, 0].tolist() == [ids[i][0] % 256 for i in idx.tolist()]


def test_grpo_groups_start_from_one_state(runtime):
    tenant = "grpo"
    _slot(runtime, tenant, "bins")
    cfg = RLConfig(env=ENV, algorithm="grpo", n_envs=4, group_size=2, segment_steps=6)
    s = Sampler(runtime, tenant, cfg, 0, Stats(), __import__("threading").Lock())
    try:
        s._reset_groups()
        st = s.obs["images"]["agentview"]
        assert np.array_equal(st[0], st[1]) and np.array_equal(st[2], st[3]) and not np.array_equal(st[0], st[2])
    finally:
        s.close()
    stats = RLRun(runtime, tenant, RLConfig(env=ENV, algorithm="grpo", mode="sync", env_steps=48, n_envs=4,
                                            group_size=2, sub_batches=1, segment_steps=6)).run()
    # a group whose envs all failed (or all succeeded) carries no signal: dropped, never trained on
    assert stats.segments_trained + stats.segments_dropped >= 1


def test_evaluation_reports_ci_and_never_touches_training(runtime):
    tenant = "evaluator"
    _slot(runtime, tenant)
    before = snapshot(runtime.training.runner.slot(tenant))
    out = evaluate(runtime, tenant, ENV, [ENV.task], episodes=3, n_envs=2)
    r = out["tasks"][ENV.task]
    assert r["episodes"] == 3 and 0 <= r["rate"] <= 1 and r["ci95"][0] <= r["rate"] <= r["ci95"][1]
    assert out["policy_versions"] == [0]
    assert same_bytes(before, snapshot(runtime.training.runner.slot(tenant)))
    again = evaluate(runtime, tenant, ENV, [ENV.task], episodes=3, n_envs=2)
    assert again["tasks"][ENV.task]["successes"] == r["successes"]  # the same seeded episodes
    assert len(r["outcomes"]) == 3 and r["outcomes"].count("1") == r["successes"]
    assert again["tasks"][ENV.task]["outcomes"] == r["outcomes"]  # episode by episode
    assert paired(out, again) == {"episodes": 3, "gained": 0, "lost": 0, "p_value": 1.0}
    lo, hi = wilson(8, 10)
    assert 0.49 < lo < 0.5 and 0.94 < hi < 0.95


def _eval_of(outcomes: str, seed: int = 10_000) -> dict:
    return {"tasks": {"t": {"outcomes": outcomes, "seed": seed}}}


def test_paired_comparison_counts_gained_and_lost_episodes_with_mcnemars_p():
    r = paired(_eval_of("0011" * 5), _eval_of("1011" * 5))  # 5 gained, none lost
    assert (r["episodes"], r["gained"], r["lost"]) == (20, 5, 0)
    assert r["p_value"] == pytest.approx(2 / 2 ** 5)  # exact: both tails of 5 fair coins all one way
    balanced = paired(_eval_of("10" * 10), _eval_of("01" * 10))  # 10 gained, 10 lost: no evidence
    assert (balanced["gained"], balanced["lost"], balanced["p_value"]) == (10, 10, 1.0)
    big = paired(_eval_of("0" * 30 + "1" * 70), _eval_of("1" * 25 + "0" * 10 + "1" * 65))  # +25, -5
    assert (big["gained"], big["lost"]) == (25, 5)
    assert big["p_value"] == pytest.approx(sum(math.comb(30, k) for k in range(6)) / 2 ** 29)
    with pytest.raises(VlamuxError, match="same seeds"):  # other seeds: not the same episodes
        paired(_eval_of("01"), _eval_of("01", seed=7))


def test_job_spec_errors_name_the_field():
    base = {"name": "j", "tenant": "acme", "kind": "rl", "head": HEAD, "rl": {"env": {"task": ENV.task}}}
    assert load_spec(base).rl.env.task == ENV.task
    cases = [({"rl": {"env": {"tsk": 1}}}, "rl.env.tsk: unknown field"),
             ({"head": {**HEAD, "horizon": "4"}}, "head.horizon: expected an integer"),
             ({"rl": {"algorithm": "dqn"}}, "rl.algorithm"),
             ({"rl": {"tasks": ["a", "b"], "sub_batches": 3}}, "rl.sub_batches: 3 must be a multiple"),
             ({"rl": {"tasks": "spatial"}}, "rl.tasks: expected a list"),
             ({"kind": "train"}, "kind:"),
             ({"optimizer": {"lr": "fast"}}, "optimizer.lr: expected a number"),
             ({"name": "a b"}, "name:")]
    for change, where in cases:
        with pytest.raises(JobSpecError, match=where.replace(".", r"\.")):
            load_spec({**base, **change})
    with pytest.raises(JobSpecError, match="tenant: required"):
        load_spec({k: v for k, v in base.items() if k != "tenant"})
    assert load_spec(json.dumps(base)).tenant == "acme"
    assert load_spec("name: j\ntenant: acme\nkind: eval\nhead: {kind: l1_chunk, action_dim: 4, horizon: 4}\n"
                     "eval: {episodes: 2}\n").eval.episodes == 2


def test_master_runs_an_sft_job_with_checkpoints_and_resumes(runtime, demos, tmp_path):
    master = MasterService(runtime, tmp_path)
    spec = {"name": "sft-acme", "tenant": "sft-acme", "kind": "sft", "head": {**HEAD, "kind": "l1_chunk"},
            "sft": {"dataset": str(demos), "steps": 6, "batch_size": 4,
                    "camera_map": {"observation.images.agentview": "agentview", "observation.images.wrist": "wrist"}},
            "eval": {"episodes": 2, "n_envs": 2, "env": {"task": ENV.task, "image_size": 16, "max_steps": 6}},
            "checkpoint_every": 2}
    job = master.wait(master.submit(spec), 300)
    assert job.state == "succeeded", job.error
    res = json.loads((tmp_path / "sft-acme" / "result.json").read_text())
    assert res["sft"]["steps"] == 6 and res["policy_version"] == 6 and "before" in res and "after" in res
    rows = list(csv.DictReader((tmp_path / "sft-acme" / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, 7)) and all(float(r["loss"]) > 0 for r in rows)
    with pytest.raises(JobSpecError, match="backbone"):
        master.submit({**spec, "backbone": "small"})

    # a second service: the job's checkpoint says step 4 of 8; it resumes there, not from 0
    state = tmp_path / "sft-acme" / "state.json"
    state.write_text(json.dumps({"phase": "sft", "step": 4, "env_steps": 0}))
    assert "sft-acme" not in runtime.training.tenants()  # the job freed its slot; the next one starts afresh
    job = master.wait(master.submit({**spec, "sft": {**spec["sft"], "steps": 8}, "eval": None}), 300)
    assert job.state == "succeeded", job.error
    rows = list(csv.DictReader((tmp_path / "sft-acme" / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows][6:] == [5, 6, 7, 8]
    assert job.result["policy_version"] == 10  # version 6 from the checkpoint, then 4 more steps


def test_master_runs_a_multi_task_rl_job_and_keeps_its_final_policy(runtime, tmp_path):
    master = MasterService(runtime, tmp_path)
    tasks = ["goal/touch-red-cube", "spatial/touch-left-cube"]
    spec = {"name": "mt", "tenant": "mt", "kind": "rl", "head": HEAD, "checkpoint_every": 1000,
            "rl": {"env": {"task": ENV.task, "image_size": 16, "max_steps": 12, "n_action_steps": 2}, "tasks": tasks,
                   "env_steps": 64, "n_envs": 2, "sub_batches": 2, "segment_steps": 4, "mode": "sync"},
            "eval": {"episodes": 2, "n_envs": 2, "before": False}}
    job = master.wait(master.submit(spec), 300)
    assert job.state == "succeeded", job.error
    assert list(job.result["after"]["tasks"]) == tasks  # evaluated on the tasks it trained on
    state = json.loads((tmp_path / "mt" / "state.json").read_text())
    version = job.result["policy_version"]
    assert state["phase"] == "rl-done" and state["env_steps"] >= 64 and version >= 1
    # resubmitted (e.g. after a restart during the final evaluation): restored, not trained again, and its
    # RL record (from the job directory) still in the result
    assert "mt" not in runtime.training.tenants()  # the job freed its slot; the next one starts afresh
    again = master.wait(master.submit(spec), 300)
    assert again.state == "succeeded", again.error
    assert again.result["rl"] == json.loads(json.dumps(job.result["rl"])) and again.result["policy_version"] == version


def test_a_resumed_job_keeps_the_evaluations_it_made_before_the_restart(runtime, demos, tmp_path):
    """SFT then RL, evaluated before, after SFT and after RL: restarted in its RL phase, the job keeps
    the first two evaluations (from its job directory) and still reports the paired comparison."""
    master = MasterService(runtime, tmp_path)
    env = {"task": ENV.task, "image_size": 16, "max_steps": 6, "n_action_steps": 2}
    spec = {"name": "evals", "tenant": "evals", "kind": "rl", "head": HEAD, "checkpoint_every": 1,
            "sft": {"dataset": str(demos), "steps": 2, "batch_size": 4},
            "rl": {"env": env, "env_steps": 32, "n_envs": 2, "sub_batches": 1, "segment_steps": 4, "mode": "sync"},
            "eval": {"episodes": 2, "n_envs": 2}}
    first = master.wait(master.submit(spec), 300)
    assert first.state == "succeeded", first.error
    assert {"before", "after_sft", "after", "paired"} <= set(first.result)
    (tmp_path / "evals" / "state.json").write_text(json.dumps({"phase": "rl", "step": 0, "env_steps": 16}))
    assert "evals" not in runtime.training.tenants()  # the job freed its slot; the next one starts afresh
    again = master.wait(master.submit(spec), 300)
    assert again.state == "succeeded", again.error
    for key in ("before", "after_sft"):
        assert again.result[key]["tasks"] == json.loads(json.dumps(first.result[key]["tasks"])), key
    assert "paired" in again.result and again.result["sft"] == first.result["sft"]


def test_an_rl_phase_restarted_from_its_checkpoint_reports_the_episodes_and_updates_of_the_whole_phase(
        runtime, tmp_path):
    """Each RL checkpoint carries the phase's record so far: a job restarted from one reports the episodes
    and updates before the restart too (env steps counted from the phase's start), not only its own."""
    master = MasterService(runtime, tmp_path)
    spec = {"name": "rec", "tenant": "rec", "kind": "rl", "head": HEAD, "checkpoint_every": 1,
            "rl": {"env": {"task": ENV.task, "image_size": 16, "max_steps": 6, "n_action_steps": 2},
                   "env_steps": 48, "n_envs": 2, "sub_batches": 1, "segment_steps": 4, "mode": "sync",
                   "critic_warmup": 0}}
    events = []
    first = master.wait(master.submit(spec, on_event=lambda job, kind, data: events.append((kind, data))), 300)
    assert first.state == "succeeded", first.error
    rl = first.result["rl"]
    assert rl["episodes"] == len(rl["curve"]) > 0 and len(rl["approx_kl"]) == rl["segments_trained"] >= 3
    assert sum(n for _, n in rl["by_task"].values()) == rl["episodes"]
    # the state at the first mid-phase checkpoint, as a restart would find it
    state = tmp_path / "rec" / "state.json"
    mid = next(d for k, d in events if k == "checkpoint" and d["phase"] == "rl")
    assert mid["env_steps"] < 48
    record = {"curve": [[n, ok] for n, ok in rl["curve"] if n <= mid["env_steps"]], "by_task": {ENV.task: [1, 9]},
              "approx_kl": [0.5], "clip_frac": [0.25], "passes": [3]}  # (marked: not what this run made)
    state.write_text(json.dumps({"phase": "rl", "step": 1, "env_steps": mid["env_steps"], "segments": 1,
                                 "record": record}))
    again = master.wait(master.submit(spec), 300)
    assert again.state == "succeeded", again.error
    rl2 = again.result["rl"]
    assert rl2["curve"][:len(record["curve"])] == record["curve"] and len(rl2["curve"]) > len(record["curve"])
    new = rl2["curve"][len(record["curve"]):]
    assert all(n > mid["env_steps"] for n, _ in new)  # counted on from the restart, not from 0
    assert rl2["approx_kl"][0] == 0.5 and rl2["clip_frac"][0] == 0.25 and rl2["passes"][0] == 3
    assert len(rl2["approx_kl"]) == rl2["segments_trained"] and rl2["env_steps"] >= 48
    assert rl2["by_task"][ENV.task][1] == 9 + len(new) and rl2["episodes"] == len(rl2["curve"])
    saved = json.loads(state.read_text())
    assert saved["phase"] == "rl-done"


def test_max_simulating_gives_jobs_simulator_phases_in_turn(runtime, demos, tmp_path, monkeypatch):
    import threading
    import time
    import vlamux.jobs.master as master_module

    spans, lock = [], threading.Lock()
    real = master_module.evaluate

    def timed(services, tenant, *args, **kwargs):  # the real evaluation, its span recorded
        t0 = time.monotonic()
        out = real(services, tenant, *args, **kwargs)
        with lock:
            spans.append((t0, time.monotonic(), tenant))
        return out

    monkeypatch.setattr(master_module, "evaluate", timed)
    with pytest.raises(VlamuxError, match="max_simulating"):
        MasterService(runtime, tmp_path, max_simulating=0)
    master = MasterService(runtime, tmp_path, max_simulating=1)
    spec = {"kind": "sft", "head": {**HEAD, "kind": "l1_chunk"},
            "sft": {"dataset": str(demos), "steps": 2, "batch_size": 4,
                    "camera_map": {"observation.images.agentview": "agentview", "observation.images.wrist": "wrist"}},
            "eval": {"episodes": 2, "n_envs": 2, "env": {"task": ENV.task, "image_size": 16, "max_steps": 6}}}
    jobs = [master.submit({**spec, "name": f"turn-{i}", "tenant": f"turn-{i}"}) for i in range(3)]
    for j in jobs:
        assert master.wait(j, 300).state == "succeeded", j.error
    spans.sort()
    assert len(spans) == 6  # before and after, each job
    # one at a time: every evaluation ends before the next begins
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans


def test_a_failing_job_fails_alone_and_cancel_stops_a_job(runtime, tmp_path):
    master = MasterService(runtime, tmp_path)
    bad = master.submit({"name": "bad", "tenant": "bad", "kind": "sft", "head": HEAD,
                         "sft": {"dataset": str(tmp_path / "missing"), "steps": 2}})
    rl = master.submit({"name": "long", "tenant": "long", "kind": "rl", "head": HEAD,
                        "rl": {"env": {"task": ENV.task, "image_size": 16, "max_steps": 12, "n_action_steps": 2},
                               "env_steps": 10**6, "n_envs": 2, "sub_batches": 1, "segment_steps": 4}})
    master.wait(bad, 120)
    assert bad.state == "failed" and "missing" in bad.error
    import time

    deadline = time.monotonic() + 120
    while rl.progress.get("phase") != "rl" and time.monotonic() < deadline:
        time.sleep(0.1)
    master.cancel(rl)
    master.wait(rl, 120)
    assert rl.state == "cancelled" and [s for _, s in rl.transitions] == ["queued", "running", "cancelled"]


def _rl_curve_with_neighbours(neighbours: int):
    """One PPO tenant (sync mode, one sub-batch: its sampling order is deterministic) with
    `neighbours` other RL tenants training at the same time on the same services."""
    import threading

    # uncapped groups: a cap learned on a busy machine can be as small as the tenant's own batch, and then
    # no group has room for a neighbour (a fresh-clone run saw shared == 0)
    rt = EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny"), group_cap=None,
                                       inference_queue=InferenceQueueConfig(batch_rows=64, max_wait_s=0.01))).start()
    try:
        rt.create_slot("me", HeadSpec(**HEAD), OptimizerSpec(lr=1e-4), seed=7).result(30)
        for i in range(neighbours):
            rt.create_slot(f"n{i}", HeadSpec(**{**HEAD, "kind": "bins"}), OptimizerSpec(lr=1e-4), seed=i).result(30)
        assert rt.publisher.flush(10)
        # the neighbours sample until "me" is done, however the machine schedules the threads, so that
        # its training and inference requests always have others' to group with
        runs = [RLRun(rt, f"n{i}", RLConfig(env=ENV, env_steps=10**6, n_envs=2, sub_batches=1, segment_steps=4,
                                            seed=50 + i)) for i in range(neighbours)]
        others = [threading.Thread(target=r.run) for r in runs]
        for th in others:
            th.start()
        try:
            # 16 updates: each has a chance to meet a neighbour's in the training queue (4 met none, now and then)
            stats = RLRun(rt, "me", RLConfig(env=ENV, mode="sync", env_steps=256, n_envs=2, sub_batches=1,
                                             segment_steps=8, minibatch_rows=8, seed=3)).run()
        finally:
            for r in runs:
                r.stop()
            for th in others:
                th.join(60)
        params = [p.detach().clone() for p in rt.training.runner.slot("me").head.parameters()]
        shared = (rt.training.accounting.usage("me").get("shared", 0),
                  sum(s.accounting.usage("me").get("shared", 0) for s in rt.replicas.values()))
        return stats, params, shared
    finally:
        rt.stop()


def test_grouping_does_not_change_an_rl_tenants_learning():
    """Same seeds, alone vs sharing its groups with 3 other RL tenants: the same episodes, losses and
    weights. Tolerance 1e-4 (grouped features equal serial ones to ~1e-6; on CPU they come out equal)."""
    alone, p_alone, _ = _rl_curve_with_neighbours(0)
    grouped, p_grouped, shared = _rl_curve_with_neighbours(3)
    assert shared[0] > 0 and shared[1] > 0  # it did share backbone forwards, in training and inference
    assert grouped.episodes == alone.episodes
    assert len(grouped.losses) == len(alone.losses) >= 3
    assert max(abs(a - b) for a, b in zip(alone.losses, grouped.losses)) <= 1e-4
    assert max((a - b).abs().max().item() for a, b in zip(p_alone, p_grouped)) <= 1e-4


def test_sft_cosine_schedule_sets_the_learning_rate_each_step(runtime, demos):
    from vlamux.workflows.sft import SFTConfig, SFTRun

    cfg = SFTConfig(dataset=str(demos), steps=4, batch_size=4, lr=1e-3, schedule="cosine")
    run = SFTRun(runtime, "cosine", 4, cfg)
    runtime.create_slot("cosine", HeadSpec(**{**HEAD, "kind": "l1_chunk"}), seed=1, stats=run.open()).result(30)
    seen = []
    run.on_step = lambda st: seen.append(runtime.training.runner.slot("cosine").optimizer.param_groups[0]["lr"])
    run.run()
    assert seen[0] == pytest.approx(1e-3, rel=1e-4) and seen == sorted(seen, reverse=True) and seen[-1] < 2e-4
    with pytest.raises(JobSpecError, match="sft.schedule"):
        load_spec({"name": "j", "tenant": "t", "kind": "sft", "head": HEAD,
                   "sft": {"dataset": "d", "schedule": "linear", "lr": 1e-3}})


def test_several_passes_over_a_segment_are_not_mistaken_for_stale_data():
    """The Training Queue refuses data more than max_staleness versions old; an update's own passes
    over its segment raise the version, and must not trip that guard."""
    rt = EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny"), max_staleness=2,
                                       inference_queue=InferenceQueueConfig(batch_rows=8, max_wait_s=0.005))).start()
    try:
        rt.create_slot("passes", HeadSpec(**HEAD), OptimizerSpec(lr=1e-4)).result(30)
        assert rt.publisher.flush(10)
        stats = RLRun(rt, "passes", RLConfig(env=ENV, mode="sync", env_steps=32, n_envs=2, sub_batches=1,
                                             segment_steps=4, epochs=4, max_staleness=2)).run()
        assert stats.version == 4 * stats.segments_trained and stats.rows_dropped == 0
    finally:
        rt.stop()


def test_target_kl_stops_an_updates_passes_once_the_policy_has_moved_that_far(runtime):
    tenant = "early-stop"
    _slot(runtime, tenant)
    runs = {}
    for target in (None, 1e-9):  # 1e-9: any move at all stops the update after its second pass
        start = runtime.training.version(tenant)
        cfg = RLConfig(env=ENV, mode="sync", env_steps=32, n_envs=2, sub_batches=1, segment_steps=4, epochs=4,
                       lr=1e-2, max_staleness=8, target_kl=target)
        st = RLRun(runtime, tenant, cfg).run()
        runs[target] = (st, runtime.training.version(tenant) - start)
    full, stopped = runs[None][0], runs[1e-9][0]
    assert full.passes == [4] * full.segments_trained and runs[None][1] == 4 * full.segments_trained
    assert stopped.passes == [2] * stopped.segments_trained and runs[1e-9][1] == 2 * stopped.segments_trained
    assert min(stopped.approx_kl) > 1e-9  # what stopped them: the second pass found the policy moved
    with pytest.raises(VlamuxError, match="target_kl"):
        RLConfig(env=ENV, target_kl=0.0)


def test_an_sft_job_with_an_adapter_starts_from_a_peft_directory_and_writes_one(runtime, demos, tmp_path):
    from safetensors.torch import load_file

    head = {**HEAD, "adapter": {"kind": "lora", "rank": 4, "alpha": 8, "target_modules": ["qkv"]}}
    spec = {"name": "lora-a", "tenant": "lora-a", "kind": "sft", "head": head,
            "sft": {"dataset": str(demos), "steps": 3, "batch_size": 4}, "checkpoint_every": 3}
    master = MasterService(runtime, tmp_path)
    first = master.wait(master.submit(spec), 300)
    assert first.state == "succeeded", first.error
    out = tmp_path / "lora-a" / "adapter"
    assert first.result["adapter"] == str(out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["target_modules"]
    trained = load_file(out / "adapter_model.safetensors")
    assert trained and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in trained)
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)  # three steps moved B off zero

    # a second tenant starts from that directory: its adapter before any step is the first one's
    again = master.wait(master.submit({**spec, "name": "lora-b", "tenant": "lora-b", "init_adapter": str(out),
                                       "sft": {**spec["sft"], "steps": 1, "lr": 1e-12}}), 300)
    assert again.state == "succeeded", again.error
    started = load_file(tmp_path / "lora-b" / "adapter" / "adapter_model.safetensors")
    assert started.keys() == trained.keys()
    assert all(torch.allclose(started[k], trained[k], atol=1e-9) for k in trained)
    with pytest.raises(JobSpecError, match="init_adapter: the head has no adapter"):
        load_spec({**spec, "head": HEAD, "init_adapter": str(out)})
    with pytest.raises(JobSpecError, match="not a PEFT adapter directory"):
        load_spec({**spec, "init_adapter": str(tmp_path)})
