"""Demonstrations of Meta-World's scripted experts (`metaworld.policies`), recorded through vlamux's
environment service as LeRobot v3.0 datasets, one per task.

What a policy sees is what LeRobot's MetaWorld setup gives a VLA: the ``corner2`` camera (moved where
LeRobot puts it, rendered at ``image_size``), a 4-D state (hand xyz, gripper opening), the task's
instruction; actions are 4-D (xyz deltas, gripper effort). The expert acts on the full state inside
the simulator's process (env option ``expert``: its action comes back in ``info``), so nothing
privileged reaches the dataset. Object and goal positions are drawn afresh at every reset
(``randomize``, LeRobot's setting) from the episode's seed; only episodes the expert finishes with
Meta-World's ``success`` are kept, and each kept episode's seed is written to
``meta/vlamux_recording.json`` beside the dataset's own metadata.

    vlamux demos metaworld/reach-v3 metaworld/push-v3 --episodes 50 --image-size 64
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from vlamux.data import demos
from vlamux.data.lerobot_writer import LeRobotWriter
from vlamux.envs.base import EnvSpec
from vlamux.workflows.rollout import replace_rows

FPS = 80  # Meta-World's control rate: 5 physics steps of 2.5 ms an action
CAMERA = "corner2"
TENANT = "demos"  # the environment service's books name the recorder as a tenant
ROBOT = "sawyer-metaworld-ee-delta"


def spec(task: str, image_size: int = 128, max_steps: int = 500, randomize: bool = True, expert: bool = True,
         cameras: tuple[str, ...] = (CAMERA,)) -> EnvSpec:
    """The environment a Meta-World tenant trains, is evaluated and records demonstrations in."""
    from vlamux.envs.metaworld import parse_task

    return EnvSpec(backend="metaworld", task=parse_task(task), image_size=image_size, cameras=cameras,
                   max_steps=max_steps, n_action_steps=1,
                   options={"state": "ee", "randomize": randomize, "view": "lerobot", "expert": expert})


def features(image_size: int, camera_dtype: str = "video") -> dict:
    from vlamux.envs.metaworld import ACTION_SPACE, EE_STATE_NAMES

    return demos.features(image_size, (CAMERA,), camera_dtype, state_names=EE_STATE_NAMES,
                          action_names=ACTION_SPACE.names)


class _Episode:
    """One env's episode as it is recorded, frame by frame."""

    def __init__(self, seed: int):
        self.seed, self.frames = seed, {k: [] for k in ("image", "state", "action", "reward", "success")}
        self.succeeded = False

    def add(self, image: np.ndarray, state: np.ndarray, action: np.ndarray) -> None:
        self.frames["image"].append(image.transpose(1, 2, 0))  # the service's [3, H, W] to LeRobot's [H, W, 3]
        self.frames["state"].append(np.asarray(state, np.float32))
        self.frames["action"].append(np.asarray(action, np.float32))

    def outcome(self, reward: float, success: bool) -> None:
        self.frames["reward"].append(np.float32(reward))
        self.frames["success"].append(bool(success))

    def columns(self) -> dict:
        f = self.frames
        return {f"observation.images.{CAMERA}": np.stack(f["image"]), "observation.state": np.stack(f["state"]),
                "action": np.stack(f["action"]), "next.reward": np.asarray(f["reward"], np.float32),
                "next.success": np.asarray(f["success"], bool)}


def record(task: str, episodes: int, out: str | Path, *, image_size: int = 128, seed: int = 0, n_envs: int = 4,
           n_workers: int | None = None, max_steps: int = 500, randomize: bool = True, camera_dtype: str = "video",
           overwrite: bool = False, service=None, progress=None, max_failures: int | None = None) -> dict:
    """Record `episodes` successful expert episodes of `task` ('reach-v3' or 'metaworld/reach-v3') to a
    LeRobot dataset at `out`, through `service` (an EnvironmentService; default: one of its own).
    Episodes are seeded seed, seed + 1, ... in order; a failed one is skipped (its seed recorded as
    failed), and more than `max_failures` (default: as many as asked for) stops the recording."""
    from vlamux.envs.metaworld import INSTRUCTIONS
    from vlamux.services.environment import EnvironmentService

    name = task.removeprefix("metaworld/")
    env = spec(name, image_size, max_steps, randomize)
    if episodes < 1 or n_envs < 1:
        raise ValueError(f"episodes and n_envs must be >= 1, got {episodes}, {n_envs}")
    max_failures = episodes if max_failures is None else max_failures
    own = service is None
    svc = EnvironmentService() if own else service
    t0, kept, failed, frames = time.perf_counter(), [], [], 0
    n = min(n_envs, episodes)
    sid = svc.open_session(TENANT, env, n, n_workers=n_workers)
    try:
        with LeRobotWriter(out, FPS, features(image_size, camera_dtype), robot_type=ROBOT,
                           overwrite=overwrite) as writer:
            next_seed = seed
            while len(kept) < episodes:
                round_seed, next_seed = next_seed, next_seed + n  # env i runs seed round_seed + i
                obs, infos = svc.reset(TENANT, sid, seed=round_seed)
                eps = [_Episode(round_seed + i) for i in range(n)]
                alive = np.ones(n, dtype=bool)
                while alive.any():
                    actions = np.stack([info["expert_action"] for info in infos])
                    for i in np.flatnonzero(alive):
                        eps[i].add(obs["images"][CAMERA][i], obs["state"][i], actions[i])
                    obs, reward, term, trunc, infos = svc.step(TENANT, sid, actions)
                    ended = np.asarray(term) | np.asarray(trunc)
                    for i in np.flatnonzero(alive):
                        eps[i].outcome(float(reward[i]), bool(infos[i]["is_success"]))
                    for i in np.flatnonzero(ended & alive):
                        eps[i].succeeded = bool(infos[i]["is_success"])
                    alive &= ~ended
                    if alive.any() and ended.any():  # finished envs idle in a throwaway episode
                        idle = np.flatnonzero(ended).tolist()
                        fresh, fresh_infos = svc.reset(TENANT, sid, seed=2**30 + round_seed, indices=idle)
                        obs = replace_rows(obs, idle, fresh)
                        for j, i in enumerate(idle):
                            infos[i] = fresh_infos[j]
                for ep in eps:  # in seed order, whichever ended first
                    if not ep.succeeded:
                        failed.append(ep.seed)
                    elif len(kept) < episodes:
                        writer.add_episode(ep.columns(), INSTRUCTIONS[env.task])
                        kept.append(ep.seed)
                        frames += len(ep.frames["action"])
                if len(failed) > max_failures:
                    raise RuntimeError(f"metaworld/{env.task}: the scripted expert failed {len(failed)} episodes "
                                       f"(seeds {failed[:10]}...) while {len(kept)} of {episodes} succeeded")
                if progress:
                    progress(len(kept), episodes)
    finally:
        svc.close_session(TENANT, sid)
        if own:
            svc.close()
    info = {"task": env.task, "instruction": INSTRUCTIONS[env.task], "episodes": len(kept), "seeds": kept,
            "failed_seeds": failed, "frames": frames, "image_size": image_size, "camera": CAMERA,
            "state": "ee (hand xyz, gripper opening)", "randomized_positions": randomize, "max_steps": max_steps,
            "expert": "metaworld.policies", "env": {"backend": env.backend, "task": env.task,
                                                   "options": env.options, "max_steps": env.max_steps},
            "seconds": time.perf_counter() - t0}
    (Path(out) / "meta" / "vlamux_recording.json").write_text(json.dumps(info, indent=1) + "\n")
    return {**info, "root": str(out)}
