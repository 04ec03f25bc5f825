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
