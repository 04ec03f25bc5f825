"""ManiSkill3 backend (`pip install 'vlamux[maniskill]'`): CPU physics, rendering on whatever
Vulkan device SAPIEN accepts.

SAPIEN needs a Vulkan device with VK_KHR_external_semaphore_fd. GPUs have it;
Mesa's CPU rasteriser (lavapipe) has it from Mesa 24.3 on — older system
Mesa builds do not, and then the backend reports itself unavailable with
that reason instead of failing inside SAPIEN. Tasks that would download
assets (YCB objects, scenes, other robots) are refused up front: only tasks
whose assets ship inside the mani_skill wheel are offered.
"""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np

from vlamux.envs.base import ActionSpace, EnvError

# Tabletop tasks with the Panda robot and primitive shapes only: nothing to download.
TASKS = {
    "PushCube-v1": "push the cube to the goal region",
    "PickCube-v1": "pick up the cube and move it to the goal position",
    "StackCube-v1": "stack the red cube on the green cube",
    "PullCube-v1": "pull the cube to the goal region",
    "PokeCube-v1": "use the peg to poke the cube to the goal",
    "PlaceSphere-v1": "place the sphere into the bin",
    "LiftPegUpright-v1": "lift the peg upright",
    "PullCubeTool-v1": "use the tool to pull the cube closer",
    "RollBall-v1": "roll the ball to the goal region",
}
CAMERAS = {"agentview": "base_camera", "wrist": "hand_camera"}


class ManiSkillUnavailable(EnvError):
    """ManiSkill3 cannot run on this machine; the message says why."""


@functools.lru_cache(maxsize=1)
def render_device() -> str:
    """The SAPIEN render device to use, or raise ManiSkillUnavailable naming the reason."""
    try:
        import sapien
    except ImportError:
        raise ManiSkillUnavailable("ManiSkill3 is not installed: pip install 'vlamux[maniskill]'") from None
    except OSError as e:  # SAPIEN's native libraries could not load (no Vulkan loader, say)
        raise ManiSkillUnavailable(f"SAPIEN could not load: {e}") from None
    for device in ("cuda", "cpu"):
        try:
            sapien.render.RenderSystem(device)
            return device
        except RuntimeError:
            continue
    raise ManiSkillUnavailable(
        "ManiSkill3 needs a Vulkan device that SAPIEN supports (VK_KHR_external_semaphore_fd); this machine has "
        "none — no GPU, and its Mesa lavapipe is older than 24.3")


class ManiSkillEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, task: str, image_size: int = 128, cameras: tuple[str, ...] = ("agentview", "wrist"),
                 max_steps: int = 100):
        if task not in TASKS:
            raise ManiSkillUnavailable(f"ManiSkill task {task!r} is not offered: it is unknown or needs downloaded "
                                       f"assets; available: {sorted(TASKS)}")
        unknown = set(cameras) - set(CAMERAS)
        if unknown:
            raise ValueError(f"maniskill cameras are {sorted(CAMERAS)}; unknown: {sorted(unknown)}")
        device = render_device()
        import mani_skill.envs  # noqa: F401  (registers the tasks)

        self.task, self.cameras, self.max_steps = task, tuple(cameras), max_steps
        self.instruction = TASKS[task]
        self._env = gym.make(task, obs_mode="rgb", control_mode="pd_ee_delta_pos", sim_backend="cpu",
                             render_backend=device, num_envs=1, max_episode_steps=max_steps,
                             sensor_configs={"width": image_size, "height": image_size})
        low, high = self._env.action_space.low.reshape(-1), self._env.action_space.high.reshape(-1)
        self.action_spec = ActionSpace(len(low), tuple(low), tuple(high), "delta_ee_pos+gripper")
        self.action_space = gym.spaces.Box(low.astype(np.float32), high.astype(np.float32), dtype=np.float32)
        img = gym.spaces.Box(0, 255, (3, image_size, image_size), np.uint8)
        obs, _ = self._env.reset(seed=0)
        state_dim = self._state(obs).shape[0]
        self.observation_space = gym.spaces.Dict({
            "images": gym.spaces.Dict({c: img for c in self.cameras}),
            "state": gym.spaces.Box(-np.inf, np.inf, (state_dim,), np.float32),
            "instruction": gym.spaces.Text(max_length=256),
        })

    @staticmethod
    def _state(obs) -> np.ndarray:
        agent = obs["agent"]
        return np.concatenate([np.asarray(agent["qpos"]).reshape(-1), np.asarray(agent["qvel"]).reshape(-1)]
                              ).astype(np.float32)

    def _obs(self, obs) -> dict:
        images = {c: np.asarray(obs["sensor_data"][CAMERAS[c]]["rgb"])[0].transpose(2, 0, 1).astype(np.uint8)
                  for c in self.cameras}
        return {"images": images, "state": self._state(obs), "instruction": self.instruction}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        obs, _ = self._env.reset(seed=seed)
        return self._obs(obs), {"is_success": False}

    def step(self, action):
        obs, reward, term, trunc, info = self._env.step(np.asarray(action, np.float32)[None])
        success = bool(np.asarray(info.get("success", False)).reshape(-1)[0])
        return (self._obs(obs), float(np.asarray(reward).reshape(-1)[0]), success,
                bool(np.asarray(trunc).reshape(-1)[0]) and not success, {"is_success": success})

    def close(self):
        self._env.close()


def make_maniskill_env(spec) -> ManiSkillEnv:
    return ManiSkillEnv(spec.task, spec.image_size, spec.cameras, spec.max_steps)
