"""The environment contract every backend follows.

A single environment is a gymnasium env whose observation is a dict:
``{"images": {camera: uint8 [3, H, W]}, "state": float32 [S], "instruction": str}``;
``info["is_success"]`` says whether the task is done, and ``env.action_spec`` (an
`ActionSpace`) declares the actions: dimensions, bounds, control mode. The vectorised form
(`vlamux.envs.workers.VectorEnv`) stacks n of them, each running in a worker
process, and executes action chunks ``n_action_steps`` at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np

from vlamux.errors import VlamuxError


class EnvError(VlamuxError):
    """A simulator call failed; the message names the env and the call."""


class EnvTimeoutError(EnvError, TimeoutError):
    """A simulator worker did not answer in time; it has been replaced."""


class EnvWorkerCrashed(EnvError):
    """A simulator worker died; it has been replaced."""


@dataclass(frozen=True)
class ActionSpace:
    dim: int
    low: tuple[float, ...]
    high: tuple[float, ...]
    control: str  # e.g. "delta_ee_pos+gripper": what the numbers mean
    names: tuple[str, ...] = ()

    def clip(self, a: np.ndarray) -> np.ndarray:
        return np.clip(a, self.low, self.high)

    def check(self, action) -> np.ndarray:
        """`action` as float64 [dim], clipped to the bounds; ValueError naming the problem if malformed."""
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.shape != (self.dim,) or not np.all(np.isfinite(a)):
            raise ValueError(f"action: expected {self.dim} finite numbers, got {np.asarray(action).tolist()}")
        return self.clip(a)


INSTRUCTION_CHARSET = "".join(chr(c) for c in range(32, 127))


def observation_space(cameras, image_size: int, state: gym.spaces.Box) -> gym.spaces.Dict:
    """The contract's observation space: uint8 [3, S, S] per camera, the state box, the instruction."""
    img = gym.spaces.Box(0, 255, (3, image_size, image_size), np.uint8)
    return gym.spaces.Dict({
        "images": gym.spaces.Dict({c: img for c in cameras}),
        "state": state,
        "instruction": gym.spaces.Text(max_length=256, charset=INSTRUCTION_CHARSET),
    })


@dataclass(frozen=True)
class EnvSpec:
    """What to simulate. `backend` picks the implementation; `task` is backend-specific."""

    backend: str = "tabletop"
    task: str = "goal/touch-red-cube"
    image_size: int = 128
    cameras: tuple[str, ...] = ("agentview", "wrist")
    max_steps: int = 120
    n_action_steps: int = 1  # actions of a chunk executed per vectorised step
    options: dict = field(default_factory=dict)
