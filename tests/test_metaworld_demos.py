"""Meta-World demonstrations recorded through the environment service (vlamux.workflows.metaworld_demos):
what is written is what the recorder saw, LeRobot's reader gives it back exactly, the state is the
4-D one (nothing privileged), and replaying an episode's actions from its seed succeeds again."""

import json

import numpy as np
import pytest

from vlamux.envs.render import configure_gl

configure_gl()
pytest.importorskip("metaworld")

from vlamux.data.lerobot import LeRobotDataset  # noqa: E402
from vlamux.workflows.metaworld_demos import CAMERA, TENANT, record, spec  # noqa: E402
from vlamux.envs.metaworld import INSTRUCTIONS, MetaWorldEnv  # noqa: E402
from vlamux.services.environment import EnvironmentService  # noqa: E402


class Watching(EnvironmentService):
    """The real service, keeping every observation and action the recorder got and sent (test-only)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def step(self, tenant, session_id, actions):
        out = super().step(tenant, session_id, actions)
        self.seen.append(np.asarray(actions).copy())
        return out


@pytest.mark.parametrize("task", ["reach-v3", "drawer-close-v3"])
def test_recorded_demonstrations_read_back_exactly_and_replay_to_success(tmp_path, task):
    out = tmp_path / task
    with Watching() as svc:
        r = record(f"metaworld/{task}", 3, out, image_size=32, n_envs=2, max_steps=200, camera_dtype="image",
                   service=svc)
        assert svc.list_sessions(TENANT) == []  # the recorder's session is closed
    assert r["episodes"] == 3 and len(r["seeds"]) == 3 and r["seeds"] == sorted(r["seeds"])
    meta = json.loads((out / "meta" / "vlamux_recording.json").read_text())
    assert meta["seeds"] == r["seeds"] and meta["env"]["options"]["state"] == "ee"
    ds = LeRobotDataset(out)
    assert ds.num_episodes == 3 and ds.fps == 80
    assert set(ds.camera_keys) == {f"observation.images.{CAMERA}"}
    for i, seed in enumerate(r["seeds"]):
        ep = ds.episode(i)
        assert ep.task == INSTRUCTIONS[task]
        state, actions = ds.episode_array(i, "observation.state"), ds.episode_array(i, "action")
        images = ds.episode_images(i, f"observation.images.{CAMERA}")
        assert state.shape == (ep.length, 4) and actions.shape == (ep.length, 4) and images.shape == (ep.length, 32, 32, 3)
        success = ds.episode_array(i, "next.success").reshape(-1)
        assert success[-1] and not success[:-1].any()  # ends at the expert's success
        # the same env, stepped here from the episode's seed with its recorded actions: the same frames
        env = MetaWorldEnv(task, image_size=32, cameras=(CAMERA,), max_steps=200, state="ee", randomize=True,
                           view="lerobot")
        obs, _ = env.reset(seed=seed)
        for t in range(ep.length):
            np.testing.assert_array_equal(images[t], obs["images"][CAMERA].transpose(1, 2, 0))
            np.testing.assert_array_equal(state[t], obs["state"])
            obs, _, term, _, info = env.step(actions[t])
        assert term and info["is_success"]
        env.close()


def test_the_policys_observation_has_no_privileged_state_and_the_expert_acts_through_the_service():
    with EnvironmentService() as svc:
        sid = svc.open_session("t", spec("push-v3", image_size=16, max_steps=300), 2)
        obs, infos = svc.reset("t", sid, seed=5)
        assert obs["state"].shape == (2, 4) and set(obs["images"]) == {CAMERA}
        assert all(i["expert_action"].shape == (4,) for i in infos)
        done = np.zeros(2, dtype=bool)
        for _ in range(300):
            obs, _, term, trunc, infos = svc.step("t", sid, np.stack([i["expert_action"] for i in infos]))
            assert not np.asarray(trunc).any()
            done |= np.asarray(term)
            if done.all():
                break
            for i in np.flatnonzero(term):  # succeeded: it idles in a fresh episode
                infos[i] = svc.reset("t", sid, seed=100, indices=[int(i)])[1][0]
        assert done.all()  # the scripted expert succeeds on both seeds, acting through the service


def test_vlamux_demos_records_a_metaworld_task_into_the_services_data_directory(tmp_path):
    from click.testing import CliRunner

    from vlamux.cli import main

    r = CliRunner().invoke(main, ["demos", "metaworld/reach-v3", "--episodes", "1", "--image-size", "16",
                                  "--workers", "1", "--data-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().splitlines()[-1] == "metaworld-reach-v3"
    assert LeRobotDataset(tmp_path / "datasets" / "metaworld-reach-v3").num_episodes == 1
    r = CliRunner().invoke(main, ["demos", "metaworld/reach-v3", "goal/touch-red-cube", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "one dataset per task" in r.stderr
    r = CliRunner().invoke(main, ["demos", "metaworld/reach-v9", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "unknown metaworld task 'reach-v9'" in r.stderr
