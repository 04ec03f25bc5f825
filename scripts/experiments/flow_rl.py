"""RL for a flow head (Flow-SDE) against the Gaussian head's RL from the same start (issue 29).

Two tenants on one set of services, at once: each behaviour-clones the same 50 noisy-expert (DART)
demonstrations of goal/touch-red-cube for the same SFT budget, is evaluated on 200 seeded episodes,
is reinforced by PPO with the same settings and env-step budget (whole-episode updates, the dense
reward), and is evaluated again on the same 200 seeds; a paired test (McNemar, exact) says whether
RL changed which episodes succeed. The flow tenant explores by Flow-SDE (its chain's noise level and
stochastic steps below) and its critic is the head's `critic` option; the deterministic ODE sampler
evaluates it.

    python scripts/experiments/flow_rl.py [--env-steps 100000] [--workdir runs/flow_rl] [--out bench/results/flow_rl.json]
    # then RL goes on from where each tenant ended (its checkpoint), another 100k env steps; the result
    # file gains the stage, and each tenant's figures run from its SFT start to the last stage
    python scripts/experiments/flow_rl.py --continue-from runs/flow_rl --workdir runs/flow_rl2

About 25 minutes a stage on 2 cores. Jobs resume from their checkpoints when the workdir exists.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vlamux.experiments.multi_tenant import CAMERAS, _runtime, _watch
from vlamux.jobs.master import MasterService
from vlamux.workflows.evaluate import paired

TASK = "goal/touch-red-cube"


def ensure_demos(root: Path, episodes: int) -> Path:
    from vlamux.data.demos import generate

    if not (root / "meta" / "info.json").exists():
        generate([TASK], episodes, root, image_size=32, workers=2, noise=0.5)
    return root


def specs(args, dataset: Path) -> list[dict]:
    env = {"task": TASK, "image_size": 32, "max_steps": 120, "n_action_steps": 4}
    sft = {"dataset": str(dataset), "camera_map": CAMERAS, "steps": args.sft_steps, "batch_size": 64, "lr": 1e-3,
           "schedule": "cosine", "warmup_steps": 100}
    # whole episodes per update (sync, 30 chunks of 4 actions = 120 steps), as the Gaussian head's
    # recipe of docs/RESULTS.md; the critic fits alone for the first updates
    rl = {"env": {**env, "options": {"reward": "dense"}}, "algorithm": "ppo", "mode": "sync",
          "env_steps": args.env_steps, "n_envs": 16, "sub_batches": 2, "segment_steps": 30, "minibatch_rows": 64,
          "epochs": args.epochs, "lr": args.lr, "max_staleness": 2 * args.epochs, "critic_warmup": 5}
    ev = {"episodes": args.episodes, "n_envs": 10, "env": env, "before": False}  # RL starts from after_sft
    head = {"action_dim": 4, "horizon": 8, "state_dim": 8}
    flow = {"noise_level": args.noise_level, "steps_trained": args.steps_trained}
    out = {
        "flow": {"head": {**head, "kind": "flow", "options": {"steps": 10, "critic": True}},
                 "rl": {**rl, "flow": flow}},
        "gaussian": {"head": {**head, "kind": "gaussian"}, "rl": rl},
    }

    def job(name: str, s: dict) -> dict:
        spec = {"name": f"{name}-ppo", "tenant": name, "kind": "rl", "head": s["head"], "optimizer": {"lr": 1e-3},
                "rl": s["rl"], "checkpoint_every": 1000}
        if not args.continue_from:
            return {**spec, "sft": sft, "eval": ev}
        # RL from the tenant's last checkpoint, its critic already fitted; its start evaluated again
        return {**spec, "init_from": str(Path(args.continue_from) / f"{name}-ppo" / "checkpoint.safetensors"),
                "rl": {**s["rl"], "critic_warmup": 0}, "eval": {**ev, "before": True}}

    return [job(name, s) for name, s in out.items() if name in args.heads]


def summary(result: dict) -> dict:
    rl = result["rl"]
    kl = [k for k in rl["approx_kl"] if k > 0]  # (the critic's warm-up updates move no policy)
    start = result.get("after_sft") or result["before"]
    return {
        "start": {k: start[k] for k in ("success", "ci95")},
        "after_rl": {k: result["after"][k] for k in ("success", "ci95")},
        "paired": result["paired"],
        "episodes": sum(t["episodes"] for t in result["after"]["tasks"].values()),
        "rl": {"env_steps": rl["env_steps"], "episodes": rl["episodes"], "updates": len(rl["approx_kl"]),
               "env_steps_per_s": rl["env_steps_per_s"], "success_while_training": rl["curve"],
               "approx_kl": rl["approx_kl"], "clip_frac": rl["clip_frac"],
               "approx_kl_mean": sum(kl) / max(1, len(kl)), "approx_kl_max": max(kl, default=0.0)},
        "wall_s": result["wall_s"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="runs/flow_rl")
    ap.add_argument("--data", default="data/flow_rl/goal-red-50-32-n05")
    ap.add_argument("--out", default="bench/results/flow_rl.json")
    ap.add_argument("--heads", default="flow,gaussian", help="comma-separated: flow, gaussian")
    ap.add_argument("--demos", type=int, default=50)
    ap.add_argument("--sft-steps", type=int, default=300, help="a middling policy: the issue asks for 40-70%%")
    ap.add_argument("--env-steps", type=int, default=100_000, help="each tenant's RL budget")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--noise-level", type=float, default=0.5)
    ap.add_argument("--steps-trained", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=200, help="evaluation episodes (the same seeds before and after)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--continue-from", default=None,
                    help="a previous stage's workdir: RL goes on from each tenant's checkpoint there (no SFT), "
                         "and --out gains the stage")
    args = ap.parse_args(argv)
    args.heads = args.heads.split(",")
    if args.continue_from and not Path(args.out).exists():
        ap.error(f"--continue-from adds a stage to {args.out}, which does not exist: run the first stage first")
    torch.set_num_threads(args.threads)
    dataset = ensure_demos(Path(args.data), args.demos)
    rt = _runtime("tiny-tabletop")
    t0 = time.time()
    last = [0.0]

    def tick(jobs) -> None:
        if time.time() - last[0] >= 30:
            last[0] = time.time()
            print(f"[{time.time() - t0:5.0f}s] " + " | ".join(f"{j.spec.tenant}: {_progress(j)}" for j in jobs),
                  flush=True)

    try:
        master = MasterService(rt, args.workdir)
        jobs = [master.submit(s) for s in specs(args, dataset)]
        _watch(jobs, tick, 6 * 3600)
    finally:
        rt.stop()
    stages = json.loads(Path(args.out).read_text())["stages"] if args.continue_from else []
    rows = {}
    for j in jobs:
        if j.state != "succeeded":
            print(f"{j.spec.name}: {j.state} {j.error}", file=sys.stderr)
            return 1
        rows[j.spec.tenant] = {**summary(j.result), "spec": j.spec.to_dict(), "result": j.result}
        r = rows[j.spec.tenant]
        p = r["paired"]
        print(f"{j.spec.tenant:9s} start {_ci(r['start'])}  after RL {_ci(r['after_rl'])}  "
              f"paired: +{p['gained']} -{p['lost']}, p = {p['p_value']:.2g}  ({r['rl']['env_steps']} env steps, "
              f"approx KL mean {r['rl']['approx_kl_mean']:.4f} max {r['rl']['approx_kl_max']:.4f})")
    stages.append({"command": "python scripts/experiments/flow_rl.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "date": time.strftime("%Y-%m-%d"), "wall_s": time.time() - t0, "tenants": rows})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "what": "PPO on a flow head (Flow-SDE) and on a Gaussian head from the same SFT start: success on the "
                "same seeded episodes after SFT and after each RL stage, paired with the SFT start",
        "task": TASK, "tenants": overall(stages), "stages": stages}, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


def overall(stages: list[dict]) -> dict:
    """Each tenant from its SFT start (the first stage's) to its last stage: env steps summed, the
    last evaluation paired with the first (the same seeds)."""
    out = {}
    for name, first in stages[0]["tenants"].items():
        sft = first["result"]["after_sft"]
        rows = [s["tenants"][name] for s in stages if name in s["tenants"]]
        last = rows[-1]["result"]["after"]
        out[name] = {"after_sft": {k: sft[k] for k in ("success", "ci95")},
                     "after_rl": {k: last[k] for k in ("success", "ci95")}, "paired": paired(sft, last),
                     "env_steps": sum(r["rl"]["env_steps"] for r in rows),
                     "by_stage": [{"env_steps": r["rl"]["env_steps"], "success": r["after_rl"]["success"],
                                   "paired_with_sft": paired(sft, r["result"]["after"])} for r in rows]}
    return out


def _progress(job) -> str:
    p = job.progress or {}
    if p.get("phase") == "rl":
        sr = "-" if p.get("success_rate") is None else f"{p['success_rate']:.2f}"
        return f"rl {p['env_steps']}/{p['of']} success {sr}"
    if p.get("phase") == "sft":
        return f"sft {p['step']}/{p['of']}"
    return str(p.get("phase", job.state))


def _ci(r: dict) -> str:
    return f"{r['success']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"


if __name__ == "__main__":
    sys.exit(main())
