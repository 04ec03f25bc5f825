"""Frozen-feature SFT vs SFT with a LoRA adapter, in the same run, through the services: per suite two
tenants share the pretrained built-in backbone, one training a head on its frozen features, one the
same head plus a LoRA adapter on the backbone's Linears, with the same demonstrations, steps, batch,
learning rate and seeds; every tenant is evaluated on the same seeded episodes. Then, optionally, RL
from the LoRA tenant's policy (head and adapter), evaluated again on the same seeds and paired.

    python -m vlamux.data.demos --suite goal --episodes 300 --image-size 32 --noise 0.5 \\
        --out data/sft_probe/goal4-300-32-n05          # and --suite object (DART demonstrations)
    python scripts/experiments/lora_sft.py --suites goal,object --steps 4000 --episodes 100 \\
        --out bench/results/lora_sft.json
    python scripts/experiments/lora_sft.py --suites goal,object --rl-from runs/lora_sft --rl-env-steps 40000 \\
        --out bench/results/lora_sft.json              # RL from those LoRA policies, merged in
    python scripts/experiments/lora_sft.py --suites object --eval-from runs/lora_sft \
        --out bench/results/lora_sft.json              # evaluate that run's policies again, merged in

`--episodes` is per task (4 tasks a suite). Writes, per suite, `frozen_success`, `lora_success`, their
95% intervals and episode counts (and `rl_*` after the RL phase), with every job's spec and result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vlamux.envs.tabletop.tasks import SUITES
from vlamux.jobs.master import MasterService
from vlamux.model import BackboneSpec
from vlamux.model.device import add_device_arguments, dtype_name, parse_device_arguments
from vlamux.services.queues import InferenceQueueConfig
from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig
from vlamux.workflows.evaluate import paired

ENV = {"backend": "tabletop", "image_size": 32, "max_steps": 120, "n_action_steps": 4}


def specs(suite: str, args) -> list[dict]:
    """The suite's jobs: frozen SFT, LoRA SFT (then RL from it when --rl-env-steps)."""
    tasks = SUITES[suite]
    head = {"kind": "gaussian", "action_dim": 4, "horizon": 8, "state_dim": 8, "width": 128, "depth": 2,
            "instruction_cond": "adaln"}
    adapter = {"kind": "lora", "rank": args.rank, "alpha": args.alpha, "target_modules": args.targets.split(",")}
    env = {**ENV, "task": tasks[0]}
    sft = {"dataset": args.dataset.format(suite=suite), "steps": args.steps, "batch_size": args.batch_size,
           "lr": args.lr, "schedule": "cosine", "warmup_steps": 100, "seed": args.seed}
    ev = {"episodes": args.episodes, "n_envs": 10, "env": env, "before": False, "tasks": tasks, "seed": args.eval_seed}
    common = {"kind": "sft", "optimizer": {"lr": args.lr}, "sft": sft, "eval": ev, "checkpoint_every": 1000,
              "seed": args.seed}
    out = [{**common, "name": f"{suite}-frozen", "tenant": f"{suite}-frozen", "head": head},
           {**common, "name": f"{suite}-lora", "tenant": f"{suite}-lora", "head": {**head, "adapter": adapter}}]
    if args.rl_env_steps:
        rl = {"env": {**env, "options": {"reward": "dense"}}, "tasks": tasks, "sub_batches": len(tasks),
              "algorithm": "ppo", "mode": "sync", "env_steps": args.rl_env_steps, "n_envs": 8, "segment_steps": 30,
              "critic_warmup": 5, "lr": args.rl_lr, "epochs": 4, "minibatch_rows": 64, "max_staleness": 8}
        out[1] = {**out[1], "kind": "rl", "rl": rl}
    return out


def rl_specs(suite: str, args) -> list[dict]:
    """RL from the LoRA tenant's SFT policy of an earlier run (its slot file: head and adapter),
    evaluated before and after on the same seeds as the SFT run's evaluation."""
    lora = specs(suite, argparse.Namespace(**{**vars(args), "rl_env_steps": args.rl_env_steps or 40_000}))[1]
    init = Path(args.rl_from) / f"{suite}-lora" / "checkpoint.safetensors"
    # the same tenant: a slot file belongs to its tenant
    return [{**lora, "name": f"{suite}-lora-rl", "sft": None, "init_from": str(init),
             "eval": {**lora["eval"], "before": True}}]


def eval_specs(suite: str, args) -> list[dict]:
    """Evaluate the frozen and LoRA tenants' final SFT policies of an earlier run again (their slot
    files), on the same seeded episodes as that run's evaluation."""
    out = []
    for spec in specs(suite, argparse.Namespace(**{**vars(args), "rl_env_steps": 0})):
        init = Path(args.eval_from) / spec["name"] / "checkpoint.safetensors"
        out.append({**spec, "kind": "eval", "name": f"{spec['name']}-eval", "sft": None, "init_from": str(init)})
    return out


def summary(result: dict, key: str) -> dict:
    r = result[key]
    episodes = sum(t["episodes"] for t in r["tasks"].values())
    return {"success": r["success"], "ci95": r["ci95"], "episodes": episodes,
            "per_task": {t: v["rate"] for t, v in r["tasks"].items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", default="goal,object")
    ap.add_argument("--dataset", default="data/sft_probe/{suite}4-300-32-n05", help="{suite} is filled in")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--targets", default="qkv,proj,mlp.0,mlp.2", help="the adapted Linears of each block")
    ap.add_argument("--episodes", type=int, default=100, help="evaluation episodes per task")
    ap.add_argument("--eval-seed", type=int, default=10_000)
    ap.add_argument("--rl-env-steps", type=int, default=0, help="RL from the LoRA policy (0: none)")
    ap.add_argument("--rl-lr", type=float, default=3e-5)
    ap.add_argument("--rl-from", default=None, metavar="WORKDIR",
                    help="only RL, from the LoRA policies an earlier run left in WORKDIR (--rl-env-steps, default 40000)")
    ap.add_argument("--eval-from", default=None, metavar="WORKDIR",
                    help="only evaluate the frozen and LoRA SFT policies an earlier run left in WORKDIR")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="runs/lora_sft")
    ap.add_argument("--out", default="bench/results/lora_sft.json")
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)
    torch.set_num_threads(args.threads)
    suites = args.suites.split(",")
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        ap.error(f"--suites: unknown {unknown}; suites: {sorted(SUITES)}")
    if args.rl_from and args.eval_from:
        ap.error("--rl-from and --eval-from: give one")
    for s in suites:
        if args.rl_from or args.eval_from:
            flag, workdir = ("--rl-from", args.rl_from) if args.rl_from else ("--eval-from", args.eval_from)
            for tenant in ([f"{s}-lora"] if args.rl_from else [f"{s}-frozen", f"{s}-lora"]):
                if not (Path(workdir) / tenant / "checkpoint.safetensors").is_file():
                    ap.error(f"{flag}: {workdir}/{tenant}/checkpoint.safetensors is missing")
        elif not Path(args.dataset.format(suite=s)).is_dir():
            ap.error(f"--dataset: {args.dataset.format(suite=s)} is missing (make it with python -m vlamux.data.demos "
                     f"--suite {s} --episodes 300 --image-size 32 --noise 0.5 --out ...)")
    rt = EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny", weights="tiny-tabletop"),
                                       device=str(device), dtype=dtype_name(dtype), max_staleness=16,
                                       inference_queue=InferenceQueueConfig(batch_rows=64, max_wait_s=0.005))).start()
    t0 = time.time()
    try:
        master = MasterService(rt, args.workdir)
        make = rl_specs if args.rl_from else eval_specs if args.eval_from else specs
        jobs = [master.submit(spec) for s in suites for spec in make(s, args)]  # all at once, on one backbone
        while any(j.thread.is_alive() for j in jobs):
            next(j for j in jobs if j.thread.is_alive()).thread.join(60)  # a finished one would return at once
            print(f"[{time.time() - t0:6.0f}s] " + "; ".join(f"{j.spec.name}: {j.progress}" for j in jobs), flush=True)
        failed = [j for j in jobs if j.state != "succeeded"]
        for j in failed:
            print(f"{j.spec.name}: {j.state} {j.error}", file=sys.stderr)
        if failed:
            return 1
        if args.rl_from:
            return _write_rl(args, argv, suites, {j.spec.name: j for j in jobs}, time.time() - t0)
        if args.eval_from:
            return _write_eval(args, argv, suites, {j.spec.name: j for j in jobs}, time.time() - t0)
        out = {"what": "frozen-feature SFT vs LoRA SFT, same demonstrations and budget, run together on the "
                       "pretrained tiny backbone through the services; then RL from the LoRA policy (docs/RESULTS.md)",
               "command": "python scripts/experiments/lora_sft.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "wall_s": time.time() - t0, "suites": {}}
        by_name = {j.spec.name: j for j in jobs}
        for s in suites:
            frozen, lora = by_name[f"{s}-frozen"].result, by_name[f"{s}-lora"].result
            f, l_ = summary(frozen, "after"), summary(lora, "after_sft" if "after_sft" in lora else "after")
            row = {"frozen_success": f["success"], "frozen_ci95": f["ci95"], "frozen_episodes": f["episodes"],
                   "lora_success": l_["success"], "lora_ci95": l_["ci95"], "lora_episodes": l_["episodes"],
                   "frozen_per_task": f["per_task"], "lora_per_task": l_["per_task"],
                   "paired_lora_vs_frozen": paired(frozen["after"], lora.get("after_sft", lora["after"])),
                   "jobs": {"frozen": frozen, "lora": lora}}
            if "after_sft" in lora:
                r = summary(lora, "after")
                row.update(rl_success=r["success"], rl_ci95=r["ci95"], rl_episodes=r["episodes"],
                           rl_per_task=r["per_task"], paired_rl_vs_lora=lora["paired"])
            out["suites"][s] = row
            print(f"{s}: frozen {f['success']:.1%} [{f['ci95'][0]:.1%}, {f['ci95'][1]:.1%}], lora {l_['success']:.1%} "
                  f"[{l_['ci95'][0]:.1%}, {l_['ci95'][1]:.1%}] over {l_['episodes']} episodes"
                  + (f"; after RL {row['rl_success']:.1%}" if "rl_success" in row else ""))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.out}")
    finally:
        rt.stop()
    return 0


def _write_eval(args, argv, suites: list[str], by_name: dict, wall_s: float) -> int:
    """The SFT policies evaluated again, replacing the suite's frozen and LoRA figures in `--out`."""
    out = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {"suites": {}}
    command = "python scripts/experiments/lora_sft.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for s in suites:
        frozen, lora = by_name[f"{s}-frozen-eval"].result, by_name[f"{s}-lora-eval"].result
        f, l_ = summary(frozen, "after"), summary(lora, "after")
        row = out["suites"].setdefault(s, {})
        row.update(frozen_success=f["success"], frozen_ci95=f["ci95"], frozen_episodes=f["episodes"],
                   lora_success=l_["success"], lora_ci95=l_["ci95"], lora_episodes=l_["episodes"],
                   frozen_per_task=f["per_task"], lora_per_task=l_["per_task"],
                   paired_lora_vs_frozen=paired(frozen["after"], lora["after"]),
                   evaluated_again={"command": command, "wall_s": wall_s, "jobs": {"frozen": frozen, "lora": lora}})
        print(f"{s}: frozen {f['success']:.1%} [{f['ci95'][0]:.1%}, {f['ci95'][1]:.1%}], lora {l_['success']:.1%} "
              f"[{l_['ci95'][0]:.1%}, {l_['ci95'][1]:.1%}] over {l_['episodes']} episodes (evaluated again)")
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


def _write_rl(args, argv, suites: list[str], by_name: dict, wall_s: float) -> int:
    """RL from the LoRA policies, merged into the SFT run's result file (`--out`) when it holds the suite."""
    out = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {"suites": {}}
    out["rl_command"] = "python scripts/experiments/lora_sft.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out["rl_wall_s"] = wall_s
    for s in suites:
        res = by_name[f"{s}-lora-rl"].result
        start, end = summary(res, "before"), summary(res, "after")
        row = out["suites"].setdefault(s, {})
        row.update(rl_start_success=start["success"], rl_start_ci95=start["ci95"], rl_success=end["success"],
                   rl_ci95=end["ci95"], rl_episodes=end["episodes"], rl_per_task=end["per_task"],
                   paired_rl_vs_lora=res["paired"], rl_job=res)
        print(f"{s}: RL from the LoRA policy {start['success']:.1%} -> {end['success']:.1%} "
              f"[{end['ci95'][0]:.1%}, {end['ci95'][1]:.1%}] over {end['episodes']} episodes")
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
