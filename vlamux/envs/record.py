"""Record an episode to a GIF (or a PNG strip) so a person can see the task.

    python -m vlamux.envs.record --task goal/push-red-cube-green-zone --policy expert --out episode.gif
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from vlamux.envs import EnvSpec, make_env


def record(spec: EnvSpec, policy: str, seed: int, out: str, every: int = 1) -> tuple[int, bool]:
    import imageio.v3 as iio

    env = make_env(spec)
    obs, _ = env.reset(seed=seed)
    if policy == "expert":
        if spec.backend != "tabletop":
            raise ValueError(f"--policy expert exists for the tabletop backend only, not {spec.backend!r}")
        from vlamux.envs.tabletop.expert import ScriptedExpert

        expert = ScriptedExpert()
        act = lambda: expert.act(env)  # noqa: E731
    else:
        rng = np.random.default_rng(seed)
        act = lambda: rng.uniform(-1, 1, env.action_space.shape)  # noqa: E731

    def frame(o):
        return np.concatenate([o["images"][c].transpose(1, 2, 0) for c in spec.cameras], axis=1)

    frames, success = [frame(obs)], False
    for t in range(spec.max_steps):
        obs, _, term, trunc, info = env.step(act())
        if t % every == 0:
            frames.append(frame(obs))
        if term or trunc:
            success = bool(info["is_success"])
            break
    frames += [frames[-1]] * 5  # hold the last frame
    if out.endswith(".png"):
        iio.imwrite(out, np.concatenate(frames[:: max(1, len(frames) // 8)][:8], axis=1))
    else:
        iio.imwrite(out, np.stack(frames), duration=100, loop=0)
    env.close()
    return len(frames), success


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="tabletop")
    ap.add_argument("--task", default="goal/push-red-cube-green-zone")
    ap.add_argument("--policy", choices=["expert", "random"], default="expert")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--out", default="episode.gif", help=".gif, or .png for an image strip")
    args = ap.parse_args(argv)
    spec = EnvSpec(backend=args.backend, task=args.task, image_size=args.size)
    n, ok = record(spec, args.policy, args.seed, args.out)
    print(f"wrote {args.out}: {n} frames, {args.task}, policy={args.policy}, success={ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
