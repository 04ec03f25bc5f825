"""The built-in tabletop suite and worker-process vectorisation."""

import dataclasses
import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from vlamux.envs import EnvError, EnvSpec, EnvTimeoutError, EnvWorkerCrashed, make_env
from vlamux.envs.tabletop.env import TabletopEnv
from vlamux.envs.tabletop.expert import ScriptedExpert
from vlamux.envs.tabletop.tasks import SUITES, TASKS
from vlamux.envs.workers import VectorEnv


def run_episode(env: TabletopEnv, seed: int, policy) -> bool:
    env.reset(seed=seed)
    if hasattr(policy, "reset"):
        policy.reset()
    for _ in range(env.max_steps):
        _, _, term, trunc, info = env.step(policy.act(env))
        if term or trunc:
            return bool(info["is_success"])
    return False


class RandomPolicy:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def act(self, env):
        return self.rng.uniform(-1, 1, 4)


def test_single_env_passes_gymnasium_checker():
    env = TabletopEnv("goal/push-red-cube-green-zone", image_size=32)
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert obs["images"]["agentview"].dtype == np.uint8 and obs["images"]["wrist"].shape == (3, 32, 32)
    assert obs["instruction"] == "push the red cube into the green zone" and info["is_success"] is False
    assert obs["images"]["agentview"].std() > 5  # a real picture, not a blank frame
    env.close()


def test_suites_mirror_libero_axes():
    assert set(SUITES) == {"spatial", "object", "goal"}
    assert all(len(ids) >= 4 for ids in SUITES.values())


@pytest.mark.parametrize("task", sorted(TASKS))
def test_scripted_expert_succeeds_and_random_rarely_does(task):
    env = TabletopEnv(task, render=False)
    expert = sum(run_episode(env, seed, ScriptedExpert()) for seed in range(20))
    assert expert >= 19, f"{task}: expert {expert}/20"
    rand = sum(run_episode(env, 1000 + seed, RandomPolicy(seed)) for seed in range(5))
    assert rand <= 1, f"{task}: random policy {rand}/5"


def test_seeding_is_reproducible():
    a, b = TabletopEnv("object/touch-blue-ball", 32), TabletopEnv("object/touch-blue-ball", 32)
    oa, _ = a.reset(seed=3)
    ob, _ = b.reset(seed=3)
    oc, _ = b.reset(seed=4)
    assert np.array_equal(oa["images"]["agentview"], ob["images"]["agentview"])
    assert not np.array_equal(oa["images"]["agentview"], oc["images"]["agentview"])
    b.reset(seed=3)
    for _ in range(5):
        act = np.array([0.5, -0.3, -0.2, 1.0])
        sa, sb = a.step(act)[0], b.step(act)[0]
        assert np.array_equal(sa["state"], sb["state"])
        assert np.array_equal(sa["images"]["wrist"], sb["images"]["wrist"])


def test_bad_action_names_the_problem():
    env = TabletopEnv("goal/touch-red-cube", render=False)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action"):
        env.step([0.0, 1.0])
    with pytest.raises(ValueError, match="action"):
        env.step([np.nan, 0, 0, 0])
    with pytest.raises(ValueError, match="unknown tabletop task"):
        TabletopEnv("goal/fly-away")


class Towards:
    """Moves the fingers straight at object `i`, open, never closing: progress without success."""

    def __init__(self, i):
        self.i = i

    def act(self, env):
        aim = env.object_pos(self.i) + np.array([0.0, 0.0, 0.04])  # stop short of the cube: no touch
        return np.append(np.clip((aim - env.fingers_centre()) / 0.03, -1, 1), -1.0)


@pytest.mark.parametrize("task", ["spatial/touch-left-cube", "spatial/lift-right-cube",
                                  "goal/push-red-cube-green-zone"])
def test_dense_reward_is_shaping_that_sums_to_progress_and_ranks_the_target(task):
    sparse, dense = TabletopEnv(task, 32, render=False), TabletopEnv(task, 32, render=False, reward="dense")
    for seed in range(3):
        for env in (sparse, dense):
            env.reset(seed=seed)
        p0, total, expert_a, expert_b = dense.progress(), 0.0, ScriptedExpert(), ScriptedExpert()
        for _ in range(dense.max_steps):
            _, r_sparse, term_s, _, _ = sparse.step(expert_a.act(sparse))
            _, r, term, trunc, info = dense.step(expert_b.act(dense))
            assert r_sparse in (0.0, 1.0) and term == term_s  # the same physics, only the reward differs
            total += r
            if term or trunc:
                break
        assert info["is_success"]
        # Potential-based: the return is success plus final minus first progress, whatever the path
        assert total == pytest.approx(1.0 + dense.progress() - p0, abs=1e-6)
        assert 0.0 <= p0 < dense.progress() < 1.0
    # Reaching above the named cube earns more than reaching above another one, and neither succeeds
    env = TabletopEnv("spatial/touch-left-cube", 32, render=False, reward="dense")
    returns = {}
    for i in (0, 2):
        env.reset(seed=5)
        returns[i] = sum(env.step(Towards(i).act(env))[1] for _ in range(25))
        assert not env.is_success()
    assert returns[0] > 0.2 > returns[2]


def test_reward_option_is_checked():
    with pytest.raises(ValueError, match="reward.*'sparse', 'dense'.*'shaped'"):
        TabletopEnv("goal/touch-red-cube", render=False, reward="shaped")
    with pytest.raises(ValueError, match="reward"):
        make_env(EnvSpec(options={"reward": "shaped", "render": False}))
    assert make_env(EnvSpec(image_size=16, options={"reward": "dense"})).reward_mode == "dense"


@pytest.fixture
def vec():
    v = VectorEnv(EnvSpec(task="goal/lift-red-cube", image_size=32, n_action_steps=2), n_envs=4, n_workers=2,
                  timeout_s=10)
    yield v
    v.close()


def test_vector_env_contract_and_chunks(vec):
    obs, infos = vec.reset(seed=0)
    assert obs["images"]["agentview"].shape == (4, 3, 32, 32) and obs["images"]["agentview"].dtype == np.uint8
    assert obs["state"].shape == (4, 8) and obs["state"].dtype == np.float32
    assert obs["instruction"] == ["pick up the red cube"] * 4 and len(infos) == 4
    assert os.getpid() not in vec.worker_pids()  # simulators never run in the caller
    chunk = np.zeros((4, 8, 4), np.float32)
    chunk[:, :, 2] = 1.0  # up
    z0 = obs["state"][:, 2].copy()
    obs, reward, term, trunc, infos = vec.step(chunk)
    assert reward.shape == (4,) and term.dtype == bool and "is_success" in infos[0]
    # two actions of the chunk ran (n_action_steps=2), each moving up to 3 cm
    assert np.all(obs["state"][:, 2] - z0 > 0.03)
    with pytest.raises(ValueError, match="actions"):
        vec.step(np.zeros((3, 4)))


def test_vector_env_seeding_reproducible(vec):
    a, _ = vec.reset(seed=5)
    b, _ = vec.reset(seed=5)
    assert np.array_equal(a["images"]["agentview"], b["images"]["agentview"])
    assert not np.array_equal(a["images"]["agentview"][0], a["images"]["agentview"][1])  # sub-env i: seed + i


@pytest.mark.serial  # a bound on detection and respawn time
def test_killed_worker_is_detected_and_replaced(vec):
    vec.reset(seed=0)
    os.kill(vec.worker_pids()[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EnvWorkerCrashed, match="died") as err:
        vec.step(np.zeros((4, 4)))
    assert time.monotonic() - t0 < vec.timeout_s
    assert err.value.failed_envs == [0, 1] and set(err.value.partial) == {2, 3}  # the healthy envs' steps
    assert vec.restarts == 1
    with pytest.raises(EnvError, match="need reset"):
        vec.step(np.zeros((4, 4)))
    vec.reset(seed=1, indices=[0, 1])
    assert vec.step(np.zeros((4, 4)))[1].shape == (4,)


@pytest.mark.serial
def test_hung_worker_times_out_and_is_replaced(vec):
    vec.reset(seed=0)
    old = vec.worker_pids()[1]
    t0 = time.monotonic()
    with pytest.raises(EnvTimeoutError, match="within 1.0s"):
        vec.debug_sleep(1, 60, timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + 5.0  # the caller is back promptly (kill + respawn included)
    assert vec.worker_pids()[1] != old
    vec.reset(seed=0)
    assert vec.step(np.zeros((4, 4)))[0]["state"].shape == (4, 8)


def test_make_env_rejects_unknown_backend_and_options():
    with pytest.raises(ValueError, match="backend"):
        make_env(EnvSpec(backend="nope"))
    with pytest.raises(ValueError, match="options"):
        make_env(EnvSpec(options={"colour": 1}))
    assert isinstance(make_env(EnvSpec(image_size=16)), gym.Env)


def test_record_writes_a_gif_a_person_can_open(tmp_path):
    import imageio.v3 as iio

    from vlamux.envs.record import record

    out = str(tmp_path / "ep.gif")
    n, ok = record(EnvSpec(task="goal/touch-red-cube", image_size=32), "expert", 0, out)
    frames = iio.imread(out)
    # GIF writers merge the identical held frames at the end
    assert ok and n - 5 <= frames.shape[0] <= n and frames.shape[1:3] == (32, 64)  # agentview | wrist


def test_env_exception_is_reported_and_workers_stay_in_step(vec):
    vec.reset(seed=0)
    bad = np.zeros((4, 4), np.float32)
    bad[3, 0] = np.nan  # the simulator in worker 1 rejects it
    with pytest.raises(EnvError, match="action") as err:
        vec.step(bad)
    assert set(err.value.partial) == {0, 1} and err.value.failed_envs == [2, 3]
    assert vec.needs_reset.tolist() == [False, False, True, True]  # env 2 may have stepped before env 3 failed
    vec.reset(seed=0, indices=[2, 3])
    obs, *_ = vec.step(np.zeros((4, 4)))  # replies are not mixed up with the failed call's
    assert obs["state"].shape == (4, 8) and vec.restarts == 0


def test_vector_env_reports_why_creation_failed():
    from vlamux.specs import SpecError

    with pytest.raises(SpecError, match="^task: unknown tabletop task"):  # the spec refuses it first
        EnvSpec(task="goal/fly-away")
    spec = EnvSpec()
    object.__setattr__(spec, "task", "goal/fly-away")  # past the spec's check: what the worker says is relayed
    with pytest.raises(EnvError, match="unknown tabletop task"):
        VectorEnv(spec, n_envs=2, n_workers=1, timeout_s=10)


def test_interrupted_call_never_leaves_a_stale_reply(vec):
    vec.reset(seed=0)

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            vec.debug_sleep(0, 2.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    obs, infos = vec.reset(seed=0)  # reads its own replies, not the sleep's
    assert obs["state"].shape == (4, 8) and len(infos) == 4


def test_failed_restart_is_retried_on_the_next_call():
    v = VectorEnv(EnvSpec(task="goal/lift-red-cube", image_size=16), n_envs=2, n_workers=2, timeout_s=10,
                  start_timeout_s=60)
    try:
        v.reset(seed=0)
        good = v.spec
        # the replacement cannot create its envs (a start timeout of a millisecond was not enough: on a
        # loaded machine the parent could wake after the new worker was already up)
        v.spec = dataclasses.replace(good, options={"bogus": 1})
        with pytest.raises(EnvTimeoutError, match="restart failed"):
            v.debug_sleep(0, 30, timeout_s=0.5)
        assert v.worker_pids()[0] is None and v.worker_pids()[1] is not None
        v.spec = good
        obs, _ = v.reset(seed=0)  # worker 0 is started again here
        assert obs["state"].shape == (2, 8) and v.worker_pids()[0] is not None
    finally:
        v.close()


def test_reset_rejects_bad_indices(vec):
    with pytest.raises(ValueError, match="indices"):
        vec.reset(seed=0, indices=[7])


def test_envs_sharing_a_process_render_their_own_scenes_after_model_swaps():
    """Object-suite resets swap the MuJoCo model, so an env closes its renderer and makes another. With
    several envs in one process, stepped in lockstep as a worker steps them, that must not corrupt the
    others' renderers: every image equals the one the same env renders alone in the process."""
    task, n, rounds, steps = "object/touch-green-cube", 4, 3, 3
    actions = np.random.default_rng(0).uniform(-1, 1, (rounds, n, steps, 4)).astype(np.float32)

    def frames_alone(i):
        env = TabletopEnv(task, image_size=32)
        out = []
        for r in range(rounds):
            out.append(env.reset(seed=100 + r * n + i)[0]["images"])
            out += [env.step(actions[r, i, t])[0]["images"] for t in range(steps)]
        env.close()
        return out

    expected = [frames_alone(i) for i in range(n)]
    envs = [TabletopEnv(task, image_size=32) for _ in range(n)]
    try:
        got = [[] for _ in range(n)]
        for r in range(rounds):
            for i, env in enumerate(envs):
                got[i].append(env.reset(seed=100 + r * n + i)[0]["images"])
            for t in range(steps):
                for i, env in enumerate(envs):
                    got[i].append(env.step(actions[r, i, t])[0]["images"])
        for i in range(n):
            for f, (want, have) in enumerate(zip(expected[i], got[i])):
                for cam in want:
                    assert np.array_equal(want[cam], have[cam]), f"env {i}, frame {f}, {cam}: another scene"
    finally:
        for env in envs:
            env.close()
