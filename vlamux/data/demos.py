"""Scripted-expert demonstrations of the built-in suite, written as a LeRobot v3.0 dataset.

Episodes are simulated in worker processes (never in the caller's) and
written by `LeRobotWriter`, so tenants can train on them and LeRobot's own
tools can read them. Only successful episodes are kept.

`noise` > 0 injects Gaussian noise into the motion the expert executes while the
dataset keeps the expert's own (clean) action, as DART does (Laskey et al., 2017):
the demonstrations then visit states slightly off the expert's path and show the
way back, which a cloned policy needs once its own errors take it there.

    python -m vlamux.data.demos --suite goal --episodes 20 --out data/demos/tabletop-goal
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from vlamux.data.lerobot_writer import LeRobotWriter
from vlamux.envs.processes import apply_environ, environ, worker_context
from vlamux.envs.render import configure_gl

FPS = 10  # the tabletop control rate


def features(image_size: int, cameras: tuple[str, ...], camera_dtype: str = "video", state_names=None,
             action_names=None) -> dict:
    """The dataset's features; cameras as "video" (mp4, LeRobot's default) or "image" (PNG in the
    parquet files: no video decoder needed to read them). State and action names: the built-in
    suite's unless given (another suite's recorder names its own)."""
    from vlamux.envs.tabletop.env import ACTION_SPACE, STATE_NAMES

    state_names = STATE_NAMES if state_names is None else state_names
    action_names = ACTION_SPACE.names if action_names is None else action_names
    if camera_dtype not in ("video", "image"):
        raise ValueError(f"camera_dtype: expected 'video' or 'image', got {camera_dtype!r}")
    out = {f"observation.images.{c}": {"dtype": camera_dtype, "shape": [image_size, image_size, 3],
                                       "names": ["height", "width", "channels"]} for c in cameras}
    out["observation.state"] = {"dtype": "float32", "shape": [len(state_names)], "names": list(state_names)}
    out["action"] = {"dtype": "float32", "shape": [len(action_names)], "names": list(action_names)}
    out["next.reward"] = {"dtype": "float32", "shape": [1], "names": None}
    out["next.success"] = {"dtype": "bool", "shape": [1], "names": None}
    return out


def expert_episode(task: str, seed: int, image_size: int, cameras: tuple[str, ...],
                   noise: float = 0.0) -> dict | None:
    """One expert episode as frame arrays, or None if the expert failed. `noise`: std of the
    Gaussian added to the executed motion (dx, dy, dz), never to the recorded action."""
    from vlamux.envs.tabletop.env import TabletopEnv
    from vlamux.envs.tabletop.expert import ScriptedExpert

    env, expert = TabletopEnv(task, image_size, cameras), ScriptedExpert()
    obs, _ = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    frames = {k: [] for k in features(image_size, cameras)}
    success = False
    for _ in range(env.max_steps):
        action = expert.act(env).astype(np.float32)
        for c in cameras:
            frames[f"observation.images.{c}"].append(obs["images"][c].transpose(1, 2, 0))
        frames["observation.state"].append(obs["state"])
        frames["action"].append(action)
        executed = action.copy()
        if noise:
            executed[:3] = np.clip(executed[:3] + rng.normal(0.0, noise, 3), -1.0, 1.0)
        obs, reward, term, trunc, info = env.step(executed)
        frames["next.reward"].append(np.float32(reward))
        frames["next.success"].append(bool(info["is_success"]))
        if term or trunc:
            success = bool(info["is_success"])
            break
    env.close()
    if not success:
        return None
    return {"task": env.task.instruction, "frames": {k: np.stack(v) for k, v in frames.items()}}


def _episodes(task: str, seeds: list[int], image_size: int, cameras: tuple[str, ...],
              noise: float) -> list[dict | None]:
    return [expert_episode(task, s, image_size, cameras, noise) for s in seeds]


def generate(tasks: list[str], episodes_per_task: int, out: str | Path, image_size: int = 128,
             cameras: tuple[str, ...] = ("agentview", "wrist"), seed: int = 0, workers: int = 2,
             overwrite: bool = False, progress=print, noise: float = 0.0, camera_dtype: str = "video") -> dict:
    """Write `episodes_per_task` successful expert episodes of each task to a LeRobot dataset at `out`."""
    t0 = time.perf_counter()
    kept, failed = 0, 0
    configure_gl()  # chosen here and exported, so the fork server and the workers render alike
    ctx = worker_context()
    with LeRobotWriter(out, FPS, features(image_size, cameras, camera_dtype), robot_type="vlamux-tabletop-cartesian",
                       overwrite=overwrite) as writer, \
            ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=apply_environ,
                                initargs=(environ(),)) as pool:
        for t_i, task in enumerate(tasks):
            need, next_seed = episodes_per_task, seed + t_i * 100_000
            while need > 0:
                seeds = list(range(next_seed, next_seed + need))
                next_seed += need
                per_worker = [seeds[w::workers] for w in range(workers) if seeds[w::workers]]
                for batch in pool.map(_episodes, [task] * len(per_worker), per_worker,
                                      [image_size] * len(per_worker), [cameras] * len(per_worker),
                                      [noise] * len(per_worker)):
                    for ep in batch:
                        if ep is None:
                            failed += 1
                            continue
                        if need > 0:
                            writer.add_episode(ep["frames"], ep["task"])
                            kept, need = kept + 1, need - 1
                if failed > 10 * episodes_per_task:
                    raise RuntimeError(f"the scripted expert keeps failing on {task!r} ({failed} failures)")
            if progress:
                progress(f"  {task}: {episodes_per_task} episodes ({time.perf_counter() - t0:.0f}s)")
    return {"episodes": kept, "failed": failed, "seconds": time.perf_counter() - t0, "root": str(out)}


def main(argv=None) -> int:
    from vlamux.envs.tabletop.tasks import SUITES, TASKS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES), help="all tasks of a suite")
    ap.add_argument("--task", action="append", default=[], help="a task id (repeatable)")
    ap.add_argument("--episodes", type=int, default=20, help="successful episodes per task")
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--noise", type=float, default=0.0,
                    help="std of the noise added to the executed motion, not to the recorded action (DART)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    tasks = (SUITES[args.suite] if args.suite else []) + args.task
    if not tasks:
        ap.error("give --suite or --task")
    for t in tasks:
        if t not in TASKS:
            ap.error(f"unknown task {t!r}")
    if not 0.0 <= args.noise <= 1.0:
        ap.error(f"--noise: expected a std in [0, 1] (actions are in [-1, 1]), got {args.noise}")
    r = generate(tasks, args.episodes, args.out, args.image_size, seed=args.seed, workers=args.workers,
                 overwrite=args.overwrite, noise=args.noise)
    print(f"wrote {r['episodes']} episodes to {r['root']} in {r['seconds']:.0f}s "
          f"({r['failed']} failed expert episodes skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
