"""The generic gymnasium adapter: any gymnasium env in the vlamux observation contract."""

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from vlamux.envs import EnvSpec, make_env
from vlamux.envs.gym_adapter import GymAdapterEnv, make_gym_env, resize_area, to_chw_uint8

PENDULUM = "InvertedPendulum-v5"  # built into gymnasium, renders through MuJoCo: no extra dependency
PENDULUM_MAP = {"images": {"agentview": "render"}, "state": "obs"}
SMALL = {"width": 64, "height": 48}  # render small; the adapter resizes to image_size


def pendulum(**kw) -> GymAdapterEnv:
    kw.setdefault("env_kwargs", SMALL)
    return GymAdapterEnv(PENDULUM, PENDULUM_MAP, "balance the pole", image_size=32, **kw)


class DictEnv(gym.Env):
    """A dict-observation env: a CHW uint8 camera, an HWC float [0, 1] camera, nested keys, Discrete actions."""

    def __init__(self):
        self.observation_space = gym.spaces.Dict({
            "pixels": gym.spaces.Dict({
                "front": gym.spaces.Box(0, 255, (3, 24, 40), np.uint8),
                "side": gym.spaces.Box(0.0, 1.0, (16, 16, 3), np.float32),
            }),
            "joints": gym.spaces.Box(-1.0, 1.0, (2,), np.float64),
            "goal": gym.spaces.Discrete(5),
        })
        self.action_space = gym.spaces.Discrete(3)

    def _obs(self):
        front = np.zeros((3, 24, 40), np.uint8)
        front[0] = 200  # red
        front[:, :, 20:] = (self.pos + 4) * 20  # right half changes with the position
        side = np.full((16, 16, 3), 0.5, np.float32)
        return {"pixels": {"front": front, "side": side},
                "joints": np.array([self.pos / 5, -self.pos / 5]), "goal": self.goal}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos, self.goal, self.t = 0, int(self.np_random.integers(5)), 0
        return self._obs(), {}

    def step(self, action):
        assert self.action_space.contains(action), action
        self.pos = int(np.clip(self.pos + action - 1, -4, 4))
        self.t += 1
        return self._obs(), float(-abs(self.pos)), False, False, {"solved": self.t >= 3}


DICT_MAP = {"images": {"front": "pixels/front", "side": "pixels/side"}, "state": ["joints", "goal"]}


def test_pendulum_passes_gymnasium_checker_and_follows_the_contract():
    env = pendulum(max_steps=5)
    with warnings.catch_warnings():  # the pendulum's own state bounds are infinite; the checker warns about it
        warnings.simplefilter("ignore", UserWarning)
        check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    img = obs["images"]["agentview"]
    assert img.shape == (3, 32, 32) and img.dtype == np.uint8 and img.std() > 3  # a real picture
    assert obs["state"].shape == (4,) and obs["state"].dtype == np.float32
    assert obs["instruction"] == "balance the pole" and info["is_success"] is False
    assert env.action_spec.dim == 1 and env.action_spec.control == "env-native"
    assert env.render().shape == (32, 32, 3)
    for t in range(5):
        obs, reward, term, trunc, info = env.step(np.zeros(1))
        assert isinstance(reward, float) and info["is_success"] is False  # no such key: never a success
        assert not term and trunc == (t == 4)  # max_steps
    with pytest.raises(ValueError, match="action"):
        env.step([0.0, 1.0])
    with pytest.raises(ValueError, match="action"):
        env.step([np.nan])
    env.close()


def test_pendulum_seeding_is_reproducible():
    # (fresh envs: gymnasium's MuJoCo renderer aims its camera at the scene as it is at the first render)
    a, b = pendulum(), pendulum()
    oa, _ = a.reset(seed=3)
    ob, _ = b.reset(seed=3)
    assert np.array_equal(oa["state"], ob["state"])
    assert not np.array_equal(oa["state"], b.reset(seed=4)[0]["state"])
    ob, _ = b.reset(seed=3)
    assert np.array_equal(oa["images"]["agentview"], ob["images"]["agentview"])
    for _ in range(3):
        sa, sb = a.step([0.5])[0], b.step([0.5])[0]
        assert np.array_equal(sa["state"], sb["state"])
        assert np.array_equal(sa["images"]["agentview"], sb["images"]["agentview"])
    a.close()
    b.close()


def test_dict_env_key_mapping_images_state_and_success():
    env = GymAdapterEnv(DictEnv(), DICT_MAP, "move right", image_size=8, success_key="solved")
    with warnings.catch_warnings():  # Discrete(3) becomes a Box action in [0, 2]; the checker prefers [-1, 1]
        warnings.simplefilter("ignore", UserWarning)
        check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=1)
    assert env.observation_space.contains(obs)
    front, side = obs["images"]["front"], obs["images"]["side"]
    assert front.shape == side.shape == (3, 8, 8) and front.dtype == side.dtype == np.uint8
    assert np.all(front[0, :, :4] == 200) and np.all(front[1:, :, :4] == 0)  # CHW source, left half red
    assert np.all(front[:, :, 4:] == 80)  # right half: (pos 0 + 4) * 20
    assert np.all(side == 128)  # HWC float [0, 1] source scaled to 0..255
    assert obs["state"].dtype == np.float32 and obs["state"].shape == (3,)
    assert obs["state"][2] == env.env.goal and info["is_success"] is False
    assert env.action_spec.dim == 1 and env.action_spec.control == "discrete_index"
    for t in range(3):
        obs, _, term, trunc, info = env.step([2.2])  # rounds to action 2: move right
        assert info["is_success"] is (t == 2) and term is (t == 2) and not trunc
    assert np.allclose(obs["state"][:2], [0.6, -0.6])
    assert np.all(obs["images"]["front"][1:, :, 4:] == 140)  # right half shows (pos 3 + 4) * 20


def test_key_mapping_errors_name_the_missing_key():
    with pytest.raises(ValueError, match="pixels/back") as err:
        GymAdapterEnv(DictEnv(), {"images": {"front": "pixels/back"}, "state": []}, "x")
    assert "front" in str(err.value) and "side" in str(err.value)  # lists what is there
    with pytest.raises(ValueError, match="'velocity'"):
        GymAdapterEnv(DictEnv(), {"images": {}, "state": ["joints", "velocity"]}, "x")
    with pytest.raises(ValueError, match="dict observation"):
        GymAdapterEnv(DictEnv(), {"images": {}, "state": "obs"}, "x")
    with pytest.raises(ValueError, match="'joints' not found"):
        GymAdapterEnv(PENDULUM, {"images": {}, "state": "joints"}, "x")
    with pytest.raises(ValueError, match="render_mode"):
        GymAdapterEnv(DictEnv(), {"images": {"cam": "render"}, "state": []}, "x")
    with pytest.raises(ValueError, match="unknown entries"):
        GymAdapterEnv(DictEnv(), {"image": {"cam": "pixels/front"}}, "x")
    with pytest.raises(ValueError, match="instruction"):
        GymAdapterEnv(DictEnv(), DICT_MAP, "caf\u00e9")
    with pytest.raises(ValueError, match="NoSuchEnv"):
        GymAdapterEnv("NoSuchEnv-v0", PENDULUM_MAP, "x")


def test_factory_reads_the_spec():
    spec = EnvSpec(backend="gym", task=PENDULUM, image_size=16, cameras=("agentview",), max_steps=3,
                   options={"key_map": PENDULUM_MAP, "instruction": "balance the pole", "env_kwargs": SMALL,
                            "control": "force"})
    env = make_gym_env(spec)
    obs, _ = env.reset(seed=0)
    assert list(obs["images"]) == ["agentview"] and obs["images"]["agentview"].shape == (3, 16, 16)
    assert env.action_spec.control == "force" and env.max_steps == 3
    env.close()
    with pytest.raises(ValueError, match=r"cameras \['wrist'\]"):  # the default spec cameras: wrist not mapped
        make_gym_env(EnvSpec(backend="gym", task=PENDULUM, options={"key_map": PENDULUM_MAP, "instruction": "x"}))
    with pytest.raises(ValueError, match="colour"):
        make_gym_env(EnvSpec(backend="gym", task=PENDULUM, options={"colour": 1}))
    with pytest.raises(ValueError, match="key_map"):
        make_gym_env(EnvSpec(backend="gym", task=PENDULUM, options={"instruction": "x"}))


def test_image_conversion():
    a = np.arange(16, dtype=np.float64).reshape(4, 4, 1)
    assert np.array_equal(resize_area(a, 2)[..., 0], [[2.5, 4.5], [10.5, 12.5]])  # 2x2 block means
    assert np.array_equal(resize_area(a, 8)[::2, ::2], a)  # enlarging copies pixels
    grey = np.full((10, 6), 7, np.uint8)
    assert np.all(to_chw_uint8(grey, 4, False, "g") == 7)
    rgba = np.zeros((5, 5, 4), np.uint8)
    rgba[..., 2] = 9
    out = to_chw_uint8(rgba, 5, False, "rgba")
    assert out.shape == (3, 5, 5) and np.all(out[2] == 9) and np.all(out[:2] == 0)
    with pytest.raises(ValueError, match="channel axis"):
        to_chw_uint8(np.zeros((5, 6, 7)), 4, False, "cam 'x'")


def _wired(backend: str) -> bool:
    try:
        make_env(EnvSpec(backend=backend, options={}))
    except ValueError as e:
        return "unknown backend" not in str(e)
    return True


@pytest.mark.skipif(not _wired("gym"), reason="backend 'gym' is not wired into vlamux.envs.make_env yet")
def test_vector_env_runs_the_adapter():
    from vlamux.envs.workers import VectorEnv

    spec = EnvSpec(backend="gym", task=PENDULUM, image_size=16, cameras=("agentview",), max_steps=20,
                   options={"key_map": PENDULUM_MAP, "instruction": "balance the pole", "env_kwargs": SMALL})
    with VectorEnv(spec, n_envs=2, n_workers=1, timeout_s=30) as vec:
        obs, infos = vec.reset(seed=0)
        assert obs["images"]["agentview"].shape == (2, 3, 16, 16) and obs["state"].shape == (2, 4)
        assert obs["instruction"] == ["balance the pole"] * 2 and infos[0]["is_success"] is False
        obs, reward, term, trunc, infos = vec.step(np.zeros((2, 1), np.float32))
        assert reward.shape == (2,) and "is_success" in infos[0]
