"""The learning experiments of docs/RESULTS.md, as jobs through the Master Service (the real service
path: a backbone forward every step, the Training and Inference Queues, the Environment Service).

    # SFT on goal/touch-red-cube, evaluated after; its checkpoint is the RL start below
    python scripts/experiments/sft_then_rl.py sft --dataset data/sft_probe/goal-red-200-32 --steps 2000
    # RL from that checkpoint: GRPO, lr 3e-5, 2 passes, 20k env steps, 100 evaluation episodes
    python scripts/experiments/sft_then_rl.py rl --init runs/exp/sft/checkpoint.safetensors \\
        --algorithm grpo --env-steps 20000 --epochs 2 --lr 3e-5

    # The spatial suite on the pretrained backbone: SFT on its 4 tasks, evaluated on all 4; then RL
    # on one task, or on all 4 (--task spatial), from that policy, evaluated on all 4 before and after
    S="--weights tiny-tabletop --instruction-cond adaln --eval-tasks spatial"
    python scripts/experiments/sft_then_rl.py sft $S --dataset data/sft_probe/spatial4-150-32 --steps 3000 \\
        --workdir runs/spatial
    python scripts/experiments/sft_then_rl.py rl $S --init runs/spatial/sft/checkpoint.safetensors \\
        --task spatial/lift-left-cube --workdir runs/spatial

    # The spatial record of docs/RESULTS.md (92% -> 96%): SFT on DART demonstrations, then PPO on all
    # 4 tasks with the dense reward, whole episodes per update (sync), twice 400k env steps
    python -m vlamux.data.demos --suite spatial --episodes 300 --image-size 32 --noise 0.5 \
        --out data/sft_probe/spatial4-300-32-n05
    python scripts/experiments/sft_then_rl.py sft $S --dataset data/sft_probe/spatial4-300-32-n05 --steps 4000 \
        --episodes 400 --workdir runs/spatial-dart
    python scripts/experiments/sft_then_rl.py rl $S --init runs/spatial-dart/sft/checkpoint.safetensors \
        --task spatial --episodes 400 --reward dense --algorithm ppo --mode sync --n-envs 16 --segment-steps 30 \
        --critic-warmup 5 --lr 3e-5 --epochs 4 --env-steps 400000 --workdir runs/dart-ppo-sync
    # a flow head: SFT, then Flow-SDE RL (PPO's critic is part of the head: give both runs one --algorithm)
    python scripts/experiments/sft_then_rl.py sft --head flow --algorithm ppo --workdir runs/flow
    python scripts/experiments/sft_then_rl.py rl --head flow --algorithm ppo --init runs/flow/sft/checkpoint.safetensors \
        --noise-level 0.5 --steps-trained 2 --workdir runs/flow
    # evaluate any checkpoint on the same seeds and pair it with another evaluation
    python scripts/experiments/sft_then_rl.py eval $S --init runs/dart-ppo-sync/rl/checkpoint.safetensors \
        --episodes 400 --workdir runs/eval --compare runs/spatial-dart/sft/result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from vlamux.envs.tabletop.tasks import SUITES
from vlamux.jobs.master import MasterService
from vlamux.model import BackboneSpec
from vlamux.services.queues import InferenceQueueConfig
from vlamux.model.device import add_device_arguments, dtype_name, parse_device_arguments
from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig
from vlamux.workflows.evaluate import paired

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 8, "state_dim": 8}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("sft", "rl", "eval"))
    ap.add_argument("--dataset", default="data/sft_probe/goal-red-200-32")
    ap.add_argument("--init", default=None, help="rl, eval: the slot file to start from (tenant 'g')")
    ap.add_argument("--compare", default=None,
                    help="a result.json evaluated on the same seeds: compare its last evaluation with this "
                         "job's, episode by episode (gained, lost, McNemar p)")
    ap.add_argument("--steps", type=int, default=2000, help="sft steps")
    ap.add_argument("--algorithm", default="grpo")
    ap.add_argument("--env-steps", type=int, default=20000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--critic-warmup", type=int, default=0)
    ap.add_argument("--episodes", type=int, default=100, help="evaluation episodes")
    ap.add_argument("--workdir", default="runs/exp")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", default=None, help="backbone weights (e.g. tiny-tabletop, the shipped pretrained)")
    ap.add_argument("--task", default="goal/touch-red-cube",
                    help="the RL task, or a suite name / comma-separated tasks (multi-task RL: a sub-batch per task)")
    ap.add_argument("--group-size", type=int, default=4, help="grpo: envs reset to one state")
    ap.add_argument("--mode", default="async", choices=("async", "sync"))
    ap.add_argument("--step-mean", action="store_true", help="grpo: weigh steps, not episodes, equally")
    ap.add_argument("--segment-steps", type=int, default=0, help="vectorised steps per segment (default: ppo 8, grpo 30)")
    ap.add_argument("--n-envs", type=int, default=8, help="envs per sub-batch")
    ap.add_argument("--eval-tasks", default="", help="a suite name or comma-separated tasks (default: --task)")
    ap.add_argument("--reward", default="sparse", choices=("sparse", "dense"),
                    help="rl: the tabletop reward (dense: potential-based shaping on top of success)")
    ap.add_argument("--instruction-cond", default="add", choices=("none", "add", "adaln"))
    ap.add_argument("--head", default="gaussian", choices=("gaussian", "flow"),
                    help="flow: a flow head (10 Euler steps; with a critic for PPO), reinforced by Flow-SDE")
    ap.add_argument("--noise-level", type=float, default=0.5, help="flow: rl.flow.noise_level")
    ap.add_argument("--steps-trained", type=int, default=0, help="flow: rl.flow.steps_trained (0: all)")
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)
    torch.set_num_threads(args.threads)
    head = {**HEAD, "instruction_cond": args.instruction_cond}
    if args.head == "flow":
        head.update(kind="flow", options={"steps": 10, "critic": args.algorithm == "ppo"})
    rl_tasks = SUITES.get(args.task) or args.task.split(",")
    env = {"task": rl_tasks[0], "image_size": 32, "max_steps": 120, "n_action_steps": 4}
    tasks = (SUITES.get(args.eval_tasks) or args.eval_tasks.split(",")) if args.eval_tasks else []
    rl = {"env": {**env, "options": {"reward": args.reward}}, "env_steps": args.env_steps, "n_envs": args.n_envs, "sub_batches": 2, "segment_steps": 8,
          "minibatch_rows": 64, "lr": args.lr, "max_staleness": 2 * args.epochs, "epochs": args.epochs,
          "algorithm": args.algorithm, "critic_warmup": args.critic_warmup, "mode": args.mode}
    if args.algorithm == "grpo":
        rl.update({"group_size": args.group_size, "segment_steps": 30, "episode_mean": not args.step_mean})
    if args.segment_steps:
        rl["segment_steps"] = args.segment_steps
    if len(rl_tasks) > 1:
        rl.update({"tasks": rl_tasks, "sub_batches": len(rl_tasks)})
    if args.head == "flow":
        rl["flow"] = {"noise_level": args.noise_level, "steps_trained": args.steps_trained}
    spec = {"name": args.what, "tenant": "g", "kind": "rl", "head": head, "optimizer": {"lr": 1e-3}, "rl": rl,
            "eval": {"episodes": args.episodes, "n_envs": 10, "env": env, "before": args.what == "rl",
                     "tasks": tasks},
            "checkpoint_every": 1000}
    if args.what == "sft":
        spec["sft"] = {"dataset": args.dataset, "steps": args.steps, "batch_size": 64, "lr": 1e-3,
                       "schedule": "cosine", "warmup_steps": 100}
        spec["kind"] = "sft"  # evaluated after (its eval section names the env)
        del spec["rl"]
    elif args.what == "eval":
        spec.update({"kind": "eval", "init_from": args.init})
        del spec["rl"]
    else:
        spec["init_from"] = args.init
    rt = EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny", weights=args.weights),
                                       device=str(device), dtype=dtype_name(dtype), max_staleness=4 * args.epochs,
                                       inference_queue=InferenceQueueConfig(batch_rows=32, max_wait_s=0.005))).start()
    try:
        job = MasterService(rt, args.workdir).submit(spec)
        t0 = time.time()
        while job.thread.is_alive():
            job.thread.join(30)
            print(f"[{time.time() - t0:5.0f}s] {job.progress}", flush=True)
        if job.state != "succeeded":
            print(job.state, job.error)
            return 1
        r = job.result
        for k in ("before", "after_sft", "after"):
            if k in r:
                lo, hi = r[k]["ci95"]
                print(f"{k:9s} success {r[k]['success']:.2f} [{lo:.2f}, {hi:.2f}] over {list(r[k]['tasks'])}")
        if r.get("paired"):
            print("paired:", r["paired"])
        if args.compare:
            other = json.loads(open(args.compare).read())
            print(f"paired with {args.compare}:", paired(other["after"], r["after"]))
        if r.get("rl"):
            print("rl:", {k: v for k, v in r["rl"].items() if k not in ("curve", "lane_busy_s", "approx_kl", "clip_frac")})
    finally:
        rt.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
