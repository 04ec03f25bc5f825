"""The Meta-World backend (metaworld 3.x) in the vlamux observation contract."""

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from vlamux.envs.render import configure_gl  # noqa: E402

configure_gl()  # metaworld imports mujoco, so the GL backend is chosen first
pytest.importorskip("metaworld")

from vlamux.envs import EnvSpec, make_env  # noqa: E402
from vlamux.envs.metaworld import (  # noqa: E402
    ACTION_SPACE, INSTRUCTIONS, MT10_TASKS, MT50_TASKS, MetaWorldEnv, make_metaworld_env,
)


def test_single_env_passes_gymnasium_checker():
    env = MetaWorldEnv("reach-v3", image_size=32)
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert set(obs["images"]) == {"corner", "gripperPOV"} and obs["instruction"] == "reach the red goal point"
    assert info["is_success"] is False and info["task"] == "reach-v3" and 0 <= info["variation"] < 50
    env.close()


def test_smoke_rendered_steps():
    env = MetaWorldEnv("pick-place-v3", image_size=48, cameras=("corner", "gripperPOV", "corner2"), max_steps=50)
    obs, _ = env.reset(seed=1)
    first = obs["images"]["corner"].copy()
    for _ in range(10):
        obs, reward, term, trunc, info = env.step(np.array([0.0, 0.5, -0.5, 1.0]))
        assert isinstance(reward, float) and isinstance(info["is_success"], bool)
        assert term is False and trunc is False
    for cam, img in obs["images"].items():
        assert img.shape == (3, 48, 48) and img.dtype == np.uint8, cam
        assert img.std() > 5, f"{cam}: blank frame"
    assert not np.array_equal(first, obs["images"]["corner"])  # the arm moved
    assert obs["state"].shape == (39,) and obs["state"].dtype == np.float32
    assert np.allclose(obs["state"][-3:], env._env._target_pos)  # MT setting: the goal is part of the state
    assert env.render().shape == (48, 48, 3)
    # the corner cameras hang upside down in the Meta-World model and are turned upright; the wrist one is not
    assert env._flip == {"corner": True, "gripperPOV": False, "corner2": True}
    env.close()


def test_task_lists_and_instructions():
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS, MT10_V3

    assert len(MT10_TASKS) == 10 and len(MT50_TASKS) == 50 and len(set(MT50_TASKS)) == 50
    assert set(MT10_TASKS) <= set(MT50_TASKS)
    assert list(MT10_TASKS) == list(MT10_V3) and set(MT50_TASKS) == set(ALL_V3_ENVIRONMENTS)
    for name in MT50_TASKS:
        text = INSTRUCTIONS[name]
        assert 0 < len(text) <= 256 and text.isascii() and text == text.strip(), name
    assert len(set(INSTRUCTIONS.values())) == 50  # every task says something different


def test_task_names_and_options_are_checked():
    with pytest.raises(ValueError, match="reach-v3") as err:  # lists the valid names
        MetaWorldEnv("fly-v3")
    assert "window-close-v3" in str(err.value)
    with pytest.raises(ValueError, match="MT10"):
        MetaWorldEnv("mt10/assembly-v3")
    with pytest.raises(ValueError, match="prefix"):
        MetaWorldEnv("ml45/reach-v3")
    with pytest.raises(ValueError, match="unknown: \\['nosecam'\\]"):
        MetaWorldEnv("reach-v3", cameras=("corner", "nosecam"))
    with pytest.raises(ValueError, match="options"):
        make_metaworld_env(EnvSpec(backend="metaworld", task="reach-v3", options={"colour": 1}))
    env = make_metaworld_env(EnvSpec(backend="metaworld", task="mt10/reach-v3", image_size=16, max_steps=3,
                                     options={"render": False}))  # default spec cameras are aliases
    obs, _ = env.reset(seed=0)
    assert set(obs["images"]) == {"agentview", "wrist"} and obs["images"]["wrist"].shape == (3, 16, 16)
    for t in range(3):
        *_, term, trunc, _ = env.step(np.zeros(4))
        assert trunc == (t == 2) and not term  # truncated at max_steps
    with pytest.raises(ValueError, match="action"):
        env.step([0.0, 1.0])
    with pytest.raises(ValueError, match="action"):
        env.step([np.nan, 0, 0, 0])
    assert ACTION_SPACE.dim == 4 and ACTION_SPACE.control == "delta_ee_pos+gripper"
    env.close()


def test_seeding_is_reproducible():
    a, b = MetaWorldEnv("reach-v3", 32), MetaWorldEnv("reach-v3", 32)
    oa, ia = a.reset(seed=3)
    ob, ib = b.reset(seed=4)
    assert ia["variation"] != ib["variation"] and not np.array_equal(oa["state"], ob["state"])
    ob, ib = b.reset(seed=3)
    assert ia["variation"] == ib["variation"] and np.array_equal(oa["state"], ob["state"])
    assert np.array_equal(oa["images"]["corner"], ob["images"]["corner"])
    for _ in range(5):
        act = np.array([0.5, -0.3, -0.2, 1.0])
        sa, sb = a.step(act)[0], b.step(act)[0]
        assert np.array_equal(sa["state"], sb["state"])
        assert np.array_equal(sa["images"]["gripperPOV"], sb["images"]["gripperPOV"])
    a.close()
    b.close()


def test_success_terminates_the_episode():
    env = MetaWorldEnv("reach-v3", render=False, max_steps=150)
    obs, _ = env.reset(seed=0)
    for _ in range(env.max_steps):
        hand, goal = obs["state"][:3], obs["state"][-3:]
        obs, reward, term, trunc, info = env.step(np.append(np.clip((goal - hand) * 50, -1, 1), -1.0))
        if term or trunc:
            break
    assert term and not trunc and info["is_success"] is True and reward > 5  # a scripted reach succeeds
    env.close()


def _wired(backend: str) -> bool:
    try:
        make_env(EnvSpec(backend=backend, task="no-such-task"))
    except ValueError as e:
        return "unknown backend" not in str(e)
    return True


@pytest.mark.skipif(not _wired("metaworld"), reason="backend 'metaworld' is not wired into vlamux.envs.make_env yet")
def test_vector_env_runs_metaworld():
    from vlamux.envs.workers import VectorEnv

    spec = EnvSpec(backend="metaworld", task="reach-v3", image_size=32, max_steps=20, n_action_steps=2)
    with VectorEnv(spec, n_envs=2, n_workers=1, timeout_s=30) as vec:
        obs, infos = vec.reset(seed=0)
        assert obs["images"]["agentview"].shape == (2, 3, 32, 32) and obs["images"]["wrist"].dtype == np.uint8
        assert obs["state"].shape == (2, 39) and obs["instruction"] == ["reach the red goal point"] * 2
        assert infos[0]["variation"] != infos[1]["variation"] or not np.array_equal(*obs["state"])
        obs, reward, term, trunc, infos = vec.step(np.zeros((2, 4, 4), np.float32))
        assert reward.shape == (2,) and isinstance(infos[0]["is_success"], bool)


def test_difficulty_groups_partition_mt50_as_lerobot_reports_them():
    from vlamux.envs.metaworld import DIFFICULTY

    assert {k: len(v) for k, v in DIFFICULTY.items()} == {"easy": 28, "medium": 11, "hard": 6, "very_hard": 5}
    tasks = [t for group in DIFFICULTY.values() for t in group]
    assert sorted(tasks) == sorted(MT50_TASKS) and len(set(tasks)) == 50


def test_the_lerobot_setting_is_four_dim_state_seeded_random_positions_and_the_expert_action():
    env = MetaWorldEnv("push-v3", image_size=16, cameras=("corner2",), state="ee", randomize=True, view="lerobot",
                       expert=True)
    starts = []
    for seed in (3, 4, 3):
        obs, info = env.reset(seed=seed)
        assert obs["state"].shape == (4,) and env.observation_space.contains(obs)
        assert info["expert_action"].shape == (4,) and np.abs(info["expert_action"]).max() <= 1
        starts.append(env._raw[4:7].copy())  # the puck's position, which the policy does not see
    assert not np.allclose(starts[0], starts[1]) and np.array_equal(starts[0], starts[2])  # drawn from the seed
    with pytest.raises(ValueError, match="option state"):
        MetaWorldEnv("push-v3", state="object")
    env.close()


def test_success_reward_is_one_on_the_step_that_succeeds_and_the_shaped_one_stays_in_info():
    def episode(reward):
        env = MetaWorldEnv("reach-v3", image_size=16, cameras=("corner2",), state="ee", randomize=True,
                           expert=True, render=False, max_steps=200, reward=reward)
        _, info = env.reset(seed=7)
        rewards, shaped, term = [], [], False
        while not term:
            _, r, term, trunc, info = env.step(info["expert_action"])
            assert not trunc  # the scripted expert reaches the goal within the steps
            rewards.append(r)
            shaped.append(info["shaped_reward"])
        env.close()
        return np.array(rewards), np.array(shaped)

    shaped_r, shaped_info = episode("shaped")
    success_r, success_info = episode("success")
    np.testing.assert_array_equal(shaped_r, shaped_info)  # the same episode (same seed, the expert's actions)
    np.testing.assert_array_equal(success_info, shaped_info)
    assert success_r[-1] == 1.0 and not success_r[:-1].any() and shaped_r[:-1].min() > 0
    with pytest.raises(ValueError, match="option reward"):
        MetaWorldEnv("reach-v3", reward="dense")
