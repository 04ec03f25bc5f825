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
from vlamux.specs import Bound, SpecError, bounded, check


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


# backend -> "module:factory"; imported on first use so a missing optional extra only matters to its users.
BACKENDS = {
    "tabletop": "vlamux.envs.tabletop.env:make_tabletop_env",
    "metaworld": "vlamux.envs.metaworld:make_metaworld_env",
    "libero": "vlamux.envs.libero:make_libero_env",
    "maniskill": "vlamux.envs.maniskill:make_maniskill_env",
    "gym": "vlamux.envs.gym_adapter:make_gym_env",
}


def check_task(backend: str, task: str) -> str | None:
    """Why (backend, task) cannot be simulated, found without starting a simulator; None if nothing
    is known to be wrong (backends other than the built-in one name their tasks only when built)."""
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; available: {sorted(BACKENDS)}"
    if backend == "tabletop":
        from vlamux.envs.tabletop.tasks import TASKS

        if task not in TASKS:
            return f"unknown tabletop task {task!r}; tasks: {sorted(TASKS)}"
    return None



@dataclass(frozen=True)
class EnvSpec:
    """What to simulate. `backend` picks the implementation; `task` is backend-specific."""

    backend: str = bounded("tabletop", length=(1, 256))  # one of vlamux.envs.BACKENDS
    task: str = bounded("goal/touch-red-cube", length=(1, 256))
    image_size: int = bounded(128, 1, 1024)
    cameras: tuple[str, ...] = bounded(("agentview", "wrist"), length=(1, 16), each=Bound(length=(1, 256)))
    max_steps: int = bounded(120, 1, 10**6)
    n_action_steps: int = bounded(1, 1, 1024)  # actions of a chunk executed per vectorised step
    options: dict = field(default_factory=dict)  # the backend's own (each backend checks them)

    def __post_init__(self):
        check(self)
        if not all(isinstance(c, str) for c in self.cameras):
            raise SpecError(f"cameras: expected camera names, got {list(self.cameras)!r}"[:200])
        object.__setattr__(self, "cameras", tuple(self.cameras))  # frozen: a list from JSON becomes a tuple
        if not isinstance(self.options, dict):
            raise SpecError(f"options: expected a mapping, got {type(self.options).__name__}")
        why = check_task(self.backend, self.task)  # known to be wrong without starting a simulator
        if why is not None:
            raise SpecError(f"{'task' if why.startswith('unknown tabletop') else 'backend'}: {why}")
