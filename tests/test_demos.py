"""Scripted-expert demonstrations written as a LeRobot v3.0 dataset and read back for training."""

import json

import numpy as np

from vlamux.data import ChunkSampler, LeRobotDataset
from vlamux.data.demos import expert_episode, generate
from vlamux.model import Observation


def test_demos_round_trip(tmp_path):
    tasks = ["goal/touch-red-cube", "spatial/lift-left-cube"]
    out = tmp_path / "demos"
    r = generate(tasks, 2, out, image_size=32, workers=1, progress=None)
    assert r["episodes"] == 4
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 10 and info["total_episodes"] == 4
    ds = LeRobotDataset(out)
    assert ds.tasks == ["touch the red cube", "pick up the cube on the left"]
    expected = expert_episode("goal/touch-red-cube", 0, 32, ("agentview", "wrist"))
    got = ds.episode_data(0)
    assert np.array_equal(got["action"], expected["frames"]["action"])  # numeric columns are exact
    assert np.array_equal(got["observation.state"], expected["frames"]["observation.state"])
    video = ds.episode_images(0, "observation.images.agentview")
    assert video.shape == expected["frames"]["observation.images.agentview"].shape
    assert np.abs(video.astype(int) - expected["frames"]["observation.images.agentview"]).mean() < 6  # mp4 is lossy
    for i in range(ds.num_episodes):
        assert bool(ds.episode_data(i)["next.success"][-1])  # only successful episodes are kept

    sampler = ChunkSampler(ds, horizon=4, batch_size=3, seed=0,
                           camera_map={"observation.images.agentview": "agentview", "observation.images.wrist": "wrist"})
    obs, actions, mask = next(iter(sampler))
    assert isinstance(obs, Observation) and obs.images["wrist"].shape == (3, 3, 32, 32)
    assert actions.shape == (3, 4, 4) and mask.shape == (3, 4)


def _replay(task: str, seed: int, actions: np.ndarray) -> np.ndarray:
    from vlamux.envs.tabletop.env import TabletopEnv

    env = TabletopEnv(task, 32, render=False)
    states = [env.reset(seed=seed)[0]["state"]]
    for a in actions[:-1]:
        states.append(env.step(a)[0]["state"])
    return np.stack(states)


def test_dart_noise_moves_the_states_but_records_the_experts_clean_actions():
    task, cams = "spatial/lift-left-cube", ("agentview",)
    clean = expert_episode(task, 3, 32, cams)["frames"]
    noisy = expert_episode(task, 3, 32, cams, noise=0.5)["frames"]
    # without noise the recorded actions are what ran: replaying them gives the recorded states
    assert np.allclose(_replay(task, 3, clean["action"]), clean["observation.state"], atol=1e-5)
    # with noise what ran was not what is recorded, so a replay leaves the recorded path ...
    drift = np.abs(_replay(task, 3, noisy["action"]) - noisy["observation.state"])[:, :3].max()
    assert drift > 0.01
    # ... and each recorded action is the expert's answer to the state it was in, run again here
    from vlamux.envs.tabletop.env import TabletopEnv
    from vlamux.envs.tabletop.expert import ScriptedExpert

    env, expert, rng = TabletopEnv(task, 32, render=False), ScriptedExpert(), np.random.default_rng(3)
    env.reset(seed=3)
    for t, recorded in enumerate(noisy["action"]):
        assert np.array_equal(expert.act(env).astype(np.float32), recorded), f"step {t}"
        env.step(np.append(np.clip(recorded[:3] + rng.normal(0.0, 0.5, 3), -1, 1), recorded[3]).astype(np.float32))
