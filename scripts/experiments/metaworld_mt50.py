"""Meta-World MT50 through the service: one tenant per task on one shared backbone (issue 30).

Stages, each resumable (a stage whose output exists is not redone; jobs resume from their checkpoints):
  demos     each task's scripted expert (metaworld.policies), recorded through the environment service
            as a LeRobot v3.0 dataset (vlamux.workflows.metaworld_demos: corner2 camera at --image-size, the
            4-D state, positions drawn at random from each episode's seed, success-filtered)
  pretrain  with --pretrain-steps N: the shared backbone trained first on the demonstrations of every
            task (or of --pretrain-tasks')
            (vlamux.pretrain --datasets: behaviour cloning with one l1_chunk head over all tasks, the
            head then dropped), as a foundation model is before tenants fine-tune it; the tenants then
            share it frozen. Without: the --backbone preset's random-initialised weights. Each variant
            ("random", "pretrained") is a block of the result file of its own
  mt10      the MT10 tasks' tenants isolated (one after another, fresh services each) and together, on
            the same services: the multi-tenant saving on a real workload (--skip-mt10 to leave it out)
  mt50      every task's tenant at once: SFT on its demonstrations, evaluated (--eval-episodes seeded
            episodes), then PPO on its task with Meta-World's reward (times --reward-scale), validated
            on other seeds (RL's policy kept only where it validated higher than the start), evaluated
            again on the same seeds as after SFT
and writes --out (bench/results/metaworld_mt50.json): per task, success after SFT and after RL with
95% intervals and the paired test; per difficulty group (LeRobot's: 28 easy, 11 medium, 6 hard,
5 very hard) and over all tasks, with a paired test pooled over every task's episodes; wall and
service-busy times; MT10's isolated vs multi-tenant times.

    python scripts/experiments/metaworld_mt50.py                 # MT50, the stated budgets below
    python scripts/experiments/metaworld_mt50.py --tasks mt10    # ten tasks
    python scripts/experiments/metaworld_mt50.py --quick         # two tasks end to end, tiny budgets (the suite)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from vlamux.workflows.metaworld_demos import CAMERA, record, spec as env_spec
from vlamux.envs.metaworld import DIFFICULTY, MT10_TASKS, MT50_TASKS, parse_task
from vlamux.experiments.multi_tenant import run
from vlamux.utils.io import atomic_write_text
from vlamux.workflows.evaluate import mcnemar, paired, wilson

QUICK_TASKS = ("reach-v3", "drawer-close-v3")
CRITIC_WARMUP = 3  # PPO's first updates fit the value head only
DEMO_MAX_STEPS = 500  # Meta-World's own horizon: the experts' demonstrations are never cut short


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="mt50", help="mt50, mt10 or comma-separated task names")
    ap.add_argument("--quick", action="store_true", help="two tasks, tiny budgets: the plumbing end to end")
    ap.add_argument("--workdir", default="runs/metaworld_mt50")
    ap.add_argument("--data", default="data/metaworld", help="where the demonstrations go (one dataset a task)")
    ap.add_argument("--out", default="bench/results/metaworld_mt50.json")
    ap.add_argument("--backbone", default="tiny", help="a preset, shipped weights or a model directory")
    ap.add_argument("--demos", type=int, default=50, help="successful expert episodes a task")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--max-steps", type=int, default=200,
                    help="an episode's steps in RL and evaluation (the experts need 40-150)")
    ap.add_argument("--sft-steps", type=int, default=2000)
    ap.add_argument("--rl-env-steps", type=int, default=20000, help="each tenant's RL budget (0: SFT only)")
    ap.add_argument("--rl-lr", type=float, default=3e-5, help="PPO's learning rate (fresh Adam moments)")
    ap.add_argument("--rl-target-kl", type=float, default=None,
                    help="PPO stops an update's passes once the policy moved this far (approx. KL; default: no stop)")
    ap.add_argument("--rl-reward", choices=("success", "shaped"), default="success",
                    help="RL's reward: 1 on success (default), or Meta-World's shaped reward, which with the "
                         "episode's end at success can pay a policy more for hovering than for succeeding")
    ap.add_argument("--reward-scale", type=float, default=None,
                    help="RL's rewards times this (default 0.01 for the shaped reward, up to 10 a step; else 1)")
    ap.add_argument("--eval-episodes", type=int, default=10, help="seeded episodes a task (LeRobot: 10)")
    ap.add_argument("--validation-episodes", type=int, default=10)
    ap.add_argument("--lora-rank", type=int, default=0, help="a LoRA of this rank on the backbone a tenant (0: none)")
    ap.add_argument("--skip-mt10", action="store_true", help="no isolated vs multi-tenant comparison")
    ap.add_argument("--demos-only", action="store_true", help="record the demonstrations, then stop")
    ap.add_argument("--pretrain-steps", type=int, default=0,
                    help="pretrain the backbone on the demonstrations first, this many steps (0: no)")
    ap.add_argument("--pretrain-tasks", default=None,
                    help="whose demonstrations pretrain the backbone: mt50, mt10 or names (default: --tasks)")
    ap.add_argument("--sim-jobs", type=int, default=8,
                    help="at most this many tenants run simulators (evaluation, RL) at once; the rest wait their "
                         "turn (each opens worker processes of 0.4-1 GB; 0: no bound)")
    ap.add_argument("--checkpoint-every", type=int, default=500,
                    help="a job checkpoints every this many SFT steps or RL segments (and at each phase's end); "
                         "a restarted job resumes from its last one (default 500: none within an RL phase of under 500 "
                         "segments, about 300k env steps at --max-steps 150)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    if args.quick:
        # every stage once, on the fewest simulator sessions (each evaluation opens one: 2-4 s of workers
        # importing Meta-World); validation is shown by tests/test_rl_validation.py
        args.tasks, args.demos, args.image_size, args.max_steps = ",".join(QUICK_TASKS), 2, 16, 40
        args.sft_steps, args.rl_env_steps, args.eval_episodes, args.validation_episodes = 4, 32, 2, 0
        args.pretrain_steps = min(args.pretrain_steps, 2)
    for flag in ("demos", "image_size", "max_steps", "sft_steps", "eval_episodes"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: expected >= 1, got {getattr(args, flag)}")
    if args.rl_target_kl is not None and not 0 < args.rl_target_kl <= 10:
        ap.error(f"--rl-target-kl: expected in (0, 10], got {args.rl_target_kl}")
    if args.reward_scale is None:
        args.reward_scale = 0.01 if args.rl_reward == "shaped" else 1.0
    if args.sim_jobs < 0:
        ap.error(f"--sim-jobs: expected >= 0, got {args.sim_jobs}")
    try:
        args.task_list = tasks_of(args.tasks)
    except ValueError as e:
        ap.error(f"--tasks: {e}")
    try:
        args.pretrain_list = tasks_of(args.pretrain_tasks) if args.pretrain_tasks else args.task_list
    except ValueError as e:
        ap.error(f"--pretrain-tasks: {e}")
    return args


def tasks_of(arg: str) -> list[str]:
    if arg.lower() in ("mt50", "mt10"):
        return list(MT50_TASKS if arg.lower() == "mt50" else MT10_TASKS)
    return [parse_task(t.strip().removeprefix("metaworld/")) for t in arg.split(",") if t.strip()]


def ensure_demos(args, tasks: list[str]) -> dict[str, Path]:
    """Each task's dataset, recorded once (one environment service for all of them)."""
    from vlamux.services.environment import EnvironmentService

    root = Path(args.data) / f"{args.image_size}px-{args.demos}ep"
    out = {t: root / t for t in tasks}
    missing = [t for t in tasks if not (out[t] / "meta" / "vlamux_recording.json").exists()]
    if missing:
        t0 = time.monotonic()
        with EnvironmentService() as svc:
            for i, t in enumerate(missing):
                r = record(t, args.demos, out[t], image_size=args.image_size, max_steps=DEMO_MAX_STEPS,
                           n_envs=4 if args.demos >= 4 else args.demos, service=svc, overwrite=True)
                print(f"  demos {i + 1}/{len(missing)} {t}: {r['episodes']} episodes, {r['frames']} frames, "
                      f"{len(r['failed_seeds'])} failed ({time.monotonic() - t0:.0f}s)", flush=True)
    return out


def pretrained_backbone(args, demos: dict[str, Path], workdir: Path) -> Path:
    """The backbone pretrained on these tasks' demonstrations (made once for a number of tasks and steps)."""
    from vlamux import pretrain

    out = workdir / f"backbone-{len(demos)}tasks-{args.pretrain_steps}steps.safetensors"
    if not out.exists():
        print(f"\n== pretraining the backbone on {len(demos)} tasks' demonstrations, {args.pretrain_steps} steps ==",
              flush=True)
        rc = pretrain.main(["--datasets", ",".join(str(p) for p in demos.values()),
                            "--camera-map", json.dumps({f"observation.images.{CAMERA}": CAMERA}),
                            "--preset", args.backbone, "--steps", str(args.pretrain_steps),
                            "--warmup", str(min(300, max(1, args.pretrain_steps // 10))),
                            "--batch", "8" if args.quick else "64", "--out", str(out)])
        if rc != 0:
            raise RuntimeError(f"pretraining the backbone failed ({rc})")
    return out


def job_specs(args, tasks: list[str], demos: dict[str, Path]) -> list[dict]:
    env = env_spec("reach-v3", args.image_size, args.max_steps, randomize=True, expert=False)
    head = {"kind": "gaussian", "action_dim": 4, "state_dim": 4, "horizon": 8}
    if args.lora_rank:
        head["adapter"] = {"kind": "lora", "rank": args.lora_rank, "alpha": 2.0 * args.lora_rank,
                           "target_modules": ["qkv", "proj", "mlp.0", "mlp.2"]}
    out = []
    for t in tasks:
        e = {"backend": "metaworld", "task": t, "image_size": env.image_size, "cameras": [CAMERA],
             "max_steps": env.max_steps, "n_action_steps": 4, "options": {**env.options}}
        sft = {"dataset": str(demos[t]), "camera_map": {f"observation.images.{CAMERA}": CAMERA},
               "steps": args.sft_steps, "batch_size": 64, "lr": 1e-3, "schedule": "cosine",
               "warmup_steps": min(100, max(1, args.sft_steps // 10))}
        ev = {"episodes": args.eval_episodes, "n_envs": min(10, args.eval_episodes), "env": e, "before": False}
        spec = {"name": f"mw-{t}", "tenant": f"mw-{t}", "head": head, "optimizer": {"lr": 1e-3},
                "checkpoint_every": args.checkpoint_every, "sft": sft}
        if args.rl_env_steps:
            episode_chunks = -(-args.max_steps // 4)
            spec.update(kind="rl", eval={**ev, "validation_episodes": args.validation_episodes},
                        rl={"env": {**e, "options": {**e["options"], "reward": args.rl_reward}},
                            "algorithm": "ppo", "mode": "sync", "env_steps": args.rl_env_steps, "n_envs": 4,
                            "sub_batches": 2, "segment_steps": episode_chunks, "minibatch_rows": 64, "epochs": 4,
                            "lr": args.rl_lr, "max_staleness": 8, "critic_warmup": CRITIC_WARMUP,
                            "reward_scale": args.reward_scale, "target_kl": args.rl_target_kl})
        else:
            spec.update(kind="sft", eval=ev)
        out.append(spec)
    return out


def _evaluation(e: dict) -> dict:
    [task] = e["tasks"].values()
    return {"success": task["rate"], "ci95": list(task["ci95"]), "episodes": task["episodes"],
            "successes": task["successes"], "outcomes": task["outcomes"]}


def _sampled(curve: list) -> dict:
    """The sampled policy's success during RL: over its first and its last quarter of episodes."""
    q = len(curve) // 4
    if not q:
        return {"episodes": len(curve)}
    return {"episodes": len(curve), "first_quarter": sum(ok for _, ok in curve[:q]) / q,
            "last_quarter": sum(ok for _, ok in curve[-q:]) / q}


def per_task(results: dict) -> dict:
    out = {}
    for name, r in results.items():
        t = name.removeprefix("mw-")
        row = {"difficulty": next(g for g, ts in DIFFICULTY.items() if t in ts), "wall_s": r.get("wall_s"),
               "sft": r.get("sft")}  # (a resumed job's wall_s counts from its restart; sft's is its own)
        if "after_sft" in r:  # an RL job: after SFT, then after RL on the same seeds
            row.update(after_sft=_evaluation(r["after_sft"]), after_rl=_evaluation(r["after"]), paired=r["paired"],
                       rl_env_steps=r["rl"]["env_steps"], rl_env_steps_per_s=r["rl"].get("env_steps_per_s"),
                       kept=r.get("validation", {}).get("kept"),
                       rl_sampled=_sampled(r["rl"].get("curve", [])),
                       # per update: how far the policy moved (the first `critic_warmup` fit the critic only)
                       rl_updates={k: r["rl"].get(k, []) for k in ("approx_kl", "clip_frac", "passes")})
            if "validation" in r:  # the policy RL started from and RL's, on the validation seeds
                v = r["validation"]
                row["validation"] = {"start": _evaluation(v["start"]), "rl": _evaluation(v["rl"]),
                                     "paired": v["paired"]}
        else:
            row.update(after_sft=_evaluation(r["after"]))
        out[t] = row
    return out


def pooled(rows: list[dict]) -> dict:
    """Success over every episode of the rows, after SFT and after RL, and RL's pooled paired test."""
    out = {"tasks": len(rows)}
    for key in ("after_sft", "after_rl"):
        have = [r[key] for r in rows if key in r]
        if have:
            s, n = sum(e["successes"] for e in have), sum(e["episodes"] for e in have)
            out[key] = {"success": s / n, "ci95": list(wilson(s, n)), "episodes": n,
                        "task_mean": sum(e["success"] for e in have) / len(have)}
    if rows and all("paired" in r for r in rows):
        out["paired"] = _pooled_pairs([r["paired"] for r in rows])
    if rows and all("validation" in r for r in rows):  # RL's policy against its start, on the validation seeds
        v = [r["validation"] for r in rows]
        out["validation"] = {**_pooled_pairs([b["paired"] for b in v]),
                             **{k: sum(b[k]["successes"] for b in v) for k in ("start", "rl")},
                             "episodes": sum(b["start"]["episodes"] for b in v)}
    if rows and all("first_quarter" in r.get("rl_sampled", {}) for r in rows):  # the tasks' mean
        out["rl_sampled"] = {k: sum(r["rl_sampled"][k] for r in rows) / len(rows)
                             for k in ("first_quarter", "last_quarter")}
    # the updates that moved the policy (those past the critic's warm-up)
    moved = {k: [x for r in rows for x in r.get("rl_updates", {}).get(k, [])[CRITIC_WARMUP:]]
             for k in ("approx_kl", "clip_frac", "passes")}
    if moved["approx_kl"]:
        out["rl_updates"] = {"policy_updates": len(moved["approx_kl"]),
                             **{f"{k}_median": statistics.median(moved[k]) for k in ("approx_kl", "clip_frac")}}
        if moved["passes"]:  # (jobs from before passes were recorded have none)
            out["rl_updates"]["passes_mean"] = statistics.mean(moved["passes"])
    return out


def _pooled_pairs(pairs: list[dict]) -> dict:
    g, lost = sum(b["gained"] for b in pairs), sum(b["lost"] for b in pairs)
    return {"gained": g, "lost": lost, "p_value": mcnemar(g, lost)}


def summary(results: dict) -> dict:
    rows = per_task(results)
    groups = {g: v for g, ts in DIFFICULTY.items() if (v := pooled([rows[t] for t in ts if t in rows]))["tasks"]}
    every = pooled(list(rows.values()))
    # the published MT50 averages (SmolVLA's and πRL's tables) are the mean of the four groups' rates
    for key in ("after_sft", "after_rl"):
        if key in every:
            every[key]["group_mean"] = sum(v[key]["success"] for v in groups.values()) / len(groups)
    return {"tasks": rows, "by_difficulty": groups, "all": every}


def versus(doc: dict) -> dict | None:
    """The pretrained backbone's tenants against the random one's after SFT, episode by episode on the
    tasks both ran (the same seeds, where both ran with the same budgets); None where they cannot be paired."""
    v = doc.get("variants", {})
    if not all("tasks" in v.get(k, {}) for k in ("random", "pretrained")):
        return None
    same = ("demos", "image_size", "max_steps", "sft_steps", "eval_episodes")
    if any(v["random"]["config"][k] != v["pretrained"]["config"][k] for k in same):
        return None
    shared = [t for t in v["pretrained"]["tasks"] if t in v["random"]["tasks"]]
    rows = {k: [v[k]["tasks"][t] for t in shared] for k in ("random", "pretrained")}

    def evaluation(rows: list[dict]) -> dict:
        return {"tasks": {t: {"outcomes": r["after_sft"]["outcomes"]} for t, r in zip(shared, rows)}}

    return {"tasks": shared, **{k: pooled(r)["after_sft"] for k, r in rows.items()},
            "paired": paired(evaluation(rows["random"]), evaluation(rows["pretrained"]))}


def _times(r: dict) -> dict:
    return {k: r[k] for k in ("wall_s", "train_util", "infer_util", "busy_s", "device", "dtype") if k in r}


def main(argv=None) -> int:
    args = parse_args(argv)
    out_path, workdir = Path(args.out), Path(args.workdir)
    doc = json.loads(out_path.read_text()) if out_path.exists() and not args.quick else {}
    config = {k: v for k, v in vars(args).items() if k not in ("task_list", "pretrain_list", "out")}
    doc.update(config=config, task_names=args.task_list, env={
        "camera": CAMERA, "state": "hand xyz + gripper (4)",
        "positions": "random at each reset, from the episode's seed",
        "rl_reward": f"{args.rl_reward} (x {args.reward_scale})", "success": "info['success']"})

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_path, json.dumps(doc, indent=1, default=str) + "\n")

    t0 = time.monotonic()
    print(f"Meta-World: {len(args.task_list)} tasks; demos {args.demos} a task at {args.image_size}px", flush=True)
    # the tenants' tasks and, with --pretrain-steps, the pretraining's (recorded once, each)
    used = args.task_list + (args.pretrain_list if args.pretrain_steps else [])
    demos = ensure_demos(args, list(dict.fromkeys(used)))
    doc["demos"] = {t: {k: v for k, v in json.loads((p / "meta" / "vlamux_recording.json").read_text()).items()
                        if k in ("episodes", "frames", "failed_seeds", "seconds")} for t, p in demos.items()}
    save()
    if args.demos_only:
        print(f"demonstrations of {len(demos)} tasks in {Path(args.data)}")
        return 0
    variant = "pretrained" if args.pretrain_steps else "random"
    vdoc, workdir = doc.setdefault("variants", {}).setdefault(variant, {}), workdir / variant
    backbone = args.backbone
    if args.pretrain_steps:
        backbone = f"{args.backbone}:{pretrained_backbone(args, {t: demos[t] for t in args.pretrain_list}, workdir)}"
    vdoc["backbone"] = backbone
    place = {"backbone": backbone, "device": args.device, "dtype": args.dtype, "max_simulating": args.sim_jobs or None}
    subset = [t for t in args.task_list if t in MT10_TASKS] if not args.quick else args.task_list
    together = None  # the multi-tenant run of every task, where MT10's is that run already
    if not args.skip_mt10 and subset and "mt10" not in vdoc:
        specs = job_specs(args, subset, demos)
        print(f"\n== MT10 ({len(subset)} tasks, {variant} backbone): isolated, one after another ==", flush=True)
        iso = run(specs, "isolated", workdir / "mt10", **place)
        print(f"   wall {iso['wall_s']:.0f}s, training busy {iso['train_util']:.1%}\n== MT10: together ==", flush=True)
        multi = run(specs, "multi", workdir / "mt10", **place)
        vdoc["mt10"] = {"config": config, "tasks": subset, "isolated": _times(iso), "multi": _times(multi),
                        "reduction": 1 - multi["wall_s"] / iso["wall_s"],
                        "train_util": [iso["train_util"], multi["train_util"]],
                        "isolated_results": summary(iso["jobs"])["all"], "multi_results": summary(multi["jobs"])["all"]}
        print(f"   wall {multi['wall_s']:.0f}s, training busy {multi['train_util']:.1%}: "
              f"{vdoc['mt10']['reduction']:.1%} less time", flush=True)
        save()
        together = multi if subset == args.task_list else None
    if together is None:
        print(f"\n== all {len(args.task_list)} tenants at once ({variant} backbone) ==", flush=True)
        together = run(job_specs(args, args.task_list, demos), "multi", workdir / "all", **place)
    # each block keeps the settings it ran with (a later run of other budgets may share the file)
    vdoc.update(summary(together["jobs"]), config=config, multi=_times(together), wall_s=time.monotonic() - t0)
    if (vs := versus(doc)) is not None:
        doc["pretrained_vs_random"] = vs
    save()
    a = vdoc["all"]
    line = (f"after SFT {a['after_sft']['success']:.3f} ({a['after_sft']['episodes']} episodes; mean of the "
            f"difficulty groups {a['after_sft']['group_mean']:.3f})")
    if "after_rl" in a:
        line += (f", after RL {a['after_rl']['success']:.3f} (groups' mean {a['after_rl']['group_mean']:.3f}), "
                 f"paired +{a['paired']['gained']} -{a['paired']['lost']}, p = {a['paired']['p_value']:.2g}")
    if "validation" in a:
        v = a["validation"]
        line += (f"; validation seeds: RL's policy {v['rl']}/{v['episodes']}, the one it started from "
                 f"{v['start']}/{v['episodes']}, paired +{v['gained']} -{v['lost']}, p = {v['p_value']:.2g}")
    print(f"\nall tasks ({variant} backbone): {line}")
    for g, v in vdoc["by_difficulty"].items():
        print(f"  {g:10s} {v['tasks']:2d} tasks: after SFT {v['after_sft']['success']:.3f}"
              + (f", after RL {v['after_rl']['success']:.3f}" if "after_rl" in v else ""))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
