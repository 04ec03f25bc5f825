"""Rendered environment steps per second, per backend, with one and two worker processes.

Each sub-env renders its cameras (agentview + wrist, 128x128) on every step; random actions;
finished episodes are reset (the reset time counts). Writes bench/results/env_throughput.json
({"cells": [...]}, rewritten as each cell finishes; "partial" until the run ends: bench/common.py).

    python bench/env_throughput.py [--seconds 10] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ResultFile, print_table  # noqa: E402

from vlamux.envs import EnvSpec  # noqa: E402
from vlamux.envs.workers import VectorEnv  # noqa: E402

BACKENDS = {
    "tabletop": EnvSpec(task="goal/push-red-cube-green-zone", image_size=128),
    "metaworld": EnvSpec(backend="metaworld", task="pick-place-v3", image_size=128),
    "libero": EnvSpec(backend="libero", task="libero_spatial/0", image_size=128),
}
EXTRAS = {"metaworld": "metaworld", "libero": "libero"}  # backend -> module its extra installs


def installed(backend: str) -> bool:
    import importlib.util

    return backend not in EXTRAS or importlib.util.find_spec(EXTRAS[backend]) is not None


def measure(spec: EnvSpec, workers: int, envs_per_worker: int, seconds: float, render_device: int | None = None
            ) -> float:
    n = workers * envs_per_worker
    with VectorEnv(spec, n_envs=n, n_workers=workers, render_device=render_device) as vec:
        obs, _ = vec.reset(seed=0)
        dim = vec.action_dim
        rng = np.random.default_rng(0)
        steps, t0, episode = 0, time.perf_counter(), 1
        while time.perf_counter() - t0 < seconds:
            _, _, term, trunc, _ = vec.step(rng.uniform(-1, 1, (n, dim)).astype(np.float32))
            steps += n
            done = np.flatnonzero(term | trunc)
            if len(done):
                vec.reset(seed=episode * n, indices=done.tolist())
                episode += 1
        return steps / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="measuring time per cell")
    ap.add_argument("--quick", action="store_true", help="2 s per cell")
    ap.add_argument("--envs-per-worker", type=int, default=2)
    # No model runs here, so there is no --device/--dtype: the one device choice is where EGL renders.
    ap.add_argument("--render-device", type=int, default=None, metavar="GPU",
                    help="GPU index MuJoCo renders on with EGL (MUJOCO_EGL_DEVICE_ID; ignored under OSMesa)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    seconds = 2.0 if args.quick else args.seconds
    backends = []
    for backend in BACKENDS:
        if installed(backend):
            backends.append(backend)
        else:
            print(f"  {backend}: not installed, skipped")
    result = ResultFile("env_throughput_quick.json" if args.quick else "env_throughput.json", args.out,
                        [f"{backend} {workers}w" for backend in backends for workers in (1, 2)], cells=[],
                        config={"seconds": seconds, "envs_per_worker": args.envs_per_worker,
                                "render_device": args.render_device})
    rows = result.payload["cells"]
    for backend in backends:
        spec = BACKENDS[backend]
        for workers in (1, 2):
            sps = measure(spec, workers, args.envs_per_worker, seconds, args.render_device)
            result.cell(f"{backend} {workers}w", {"backend": backend, "workers": workers, "steps_per_s": sps,
                                                  "image_size": spec.image_size, "cameras": len(spec.cameras)})
            print(f"  {backend} workers={workers}: {sps:.0f} rendered steps/s", flush=True)
    print()
    print_table(rows, [("backend", "s"), ("workers", "d"), ("steps_per_s", ".0f")])
    path = result.finish()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
