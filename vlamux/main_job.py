"""The main job: the multi-tenant experiment a user of vlamux cares about, on this machine.

Four RL tenants (a flow head reinforced by Flow-SDE PPO, gaussian PPO, bins PPO, gaussian GRPO)
share one frozen backbone on the embedded runtime — the built-in tiny backbone with its shipped
weights, pretrained on the built-in MuJoCo suite — and two of them (flow, bins) train a LoRA adapter
on it beside their head. Every tenant clones the scripted noisy-expert (DART) demonstrations first,
then reinforces from there; each is evaluated before, after SFT and after RL on the same seeded
episodes, and the last two are paired. The jobs run all at once (requests of different tenants share
backbone forwards), then — unless --no-isolated — one after another, each with the services to
itself, so the run ends with the time multi-tenancy saved.

    python -m vlamux.main_job [--quick] [--no-isolated] [--workdir runs/main] [--device auto] [--dtype auto]
                              [--backbone tiny-tabletop | tiny | DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

from vlamux.experiments.multi_tenant import Budget, ensure_demos, job_specs, run
from vlamux.model.backbones import spec_from_arg
from vlamux.model.device import add_device_arguments, dtype_name, parse_device_arguments


def _line(jobs, t0: float) -> str:
    parts = []
    for j in jobs:
        p = j.progress
        if j.state != "running" or not p:
            parts.append(f"{j.spec.name}: {j.state}")
        elif p.get("phase") == "sft":
            parts.append(f"{j.spec.name}: sft {p['step']}/{p['of']} loss {p['loss']:.3f}")
        elif p.get("phase") == "rl":
            sr = "-" if p.get("success_rate") is None else f"{p['success_rate']:.2f}"
            parts.append(f"{j.spec.name}: rl {p['env_steps']}/{p['of']} steps, success {sr}, "
                         f"v{p['policy_version']}, lag {p['staleness']}, {p['env_steps_per_s']:.0f} steps/s")
        else:
            parts.append(f"{j.spec.name}: {p.get('phase')}")
    return f"[{time.monotonic() - t0:6.0f}s] " + " | ".join(parts)


def _ticker(every_s: float):
    state = {"last": 0.0, "t0": time.monotonic()}

    def tick(jobs) -> None:
        now = time.monotonic()
        if now - state["last"] >= every_s or all(not j.thread.is_alive() for j in jobs):
            state["last"] = now
            print(_line(jobs, state["t0"]), flush=True)

    return tick


def _module(spec: dict) -> str:
    a = spec["head"].get("adapter")
    return f"head + LoRA r{a['rank']}" if a else "head on frozen features"


def _ci(r: dict) -> str:
    lo, hi = r["ci95"]
    return f"{r['success']:.2f} [{lo:.2f}, {hi:.2f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny budget: checks the plumbing in about a minute")
    ap.add_argument("--no-isolated", action="store_true", help="skip the one-after-another comparison run")
    ap.add_argument("--workdir", default="runs/main")
    ap.add_argument("--data", default="data/demos")
    ap.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    ap.add_argument("--backbone", default="tiny-tabletop", metavar="PRESET_OR_DIR",
                    help="the shared backbone: shipped weights (tiny-tabletop), a built-in preset (random "
                         "weights), or a model directory (a transformers VLM)")
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)
    budget = Budget.quick() if args.quick else Budget()
    workdir = Path(args.workdir)
    if workdir.exists():  # a fresh experiment (jobs would otherwise resume from these checkpoints)
        shutil.rmtree(workdir)

    print(f"demonstrations: {budget.demos} scripted episodes of the built-in suite (expert motion noise "
          f"{budget.demo_noise:g}) ...", flush=True)
    dataset = ensure_demos(budget, args.data)
    try:
        spec_from_arg(args.backbone)
    except ValueError as e:
        ap.error(str(e))
    specs = job_specs(budget, dataset, args.backbone)
    print(f"\n{len(specs)} tenants on one shared frozen backbone ({args.backbone}, {device}, {dtype_name(dtype)}), "
          f"embedded runtime:")
    module = {s["tenant"]: _module(s) for s in specs}
    for s in specs:
        what = "SFT" if s["kind"] == "sft" else f"SFT warm start, then RL ({s['rl'].get('algorithm', 'ppo')})"
        print(f"  {s['tenant']:14s} head {s['head']['kind']:9s} {module[s['tenant']]:24s} {what}")

    print("\n== multi-tenant: all jobs at once ==", flush=True)
    place = {"device": str(device), "dtype": dtype_name(dtype), "backbone": args.backbone}
    multi = run(specs, "multi", workdir, on_tick=_ticker(args.progress_every), **place)
    isolated = None
    if not args.no_isolated:
        print("\n== isolated: the same jobs one after another, each with the services to itself ==", flush=True)
        isolated = run(specs, "isolated", workdir, on_tick=_ticker(args.progress_every), **place)

    print(f"\nresults per tenant (success on {budget.eval_episodes} seeded episodes, 95% CI; RL tenants: the same "
          f"seeds after SFT and after RL, paired episode by episode):")
    for name, r in multi["jobs"].items():
        extra = ""
        if "rl" in r:
            p = r["paired"]
            extra = f"  paired +{p['gained']} -{p['lost']}, p = {p['p_value']:.2g}  (RL: {r['rl']['env_steps']} env " \
                    f"steps, {r['rl']['env_steps_per_s']:.0f}/s, max lag {r['rl']['max_staleness_seen']})"
        warm = f"  after SFT {_ci(r['after_sft'])}" if "after_sft" in r else ""
        print(f"  {name:14s} {module[name]:24s} before {_ci(r['before'])}{warm}  after {_ci(r['after'])}{extra}")
        if "validation" in r:  # selected on other seeds than the table's: the table stays unbiased
            v, first = r["validation"], next(iter(r["validation"]["rl"]["tasks"].values()))
            print(f"  {'':14s} validation ({first['episodes']} episodes from seed {first['seed']:,}): start {v['start']['success']:.2f}, RL's "
                  f"{v['rl']['success']:.2f} -> kept {'RL' if v['kept'] == 'rl' else 'the start (RL validated no higher)'}")
    low = [n for n, r in multi["jobs"].items() if r["after"]["success"] < 0.70]
    print(f"  every tenant ends at >= 70% over {budget.eval_episodes} episodes" if not low else
          f"  below 70% over {budget.eval_episodes} episodes: {', '.join(low)}")
    fell = [n for n, r in multi["jobs"].items() if "after_sft" in r and r["after"]["success"] < r["after_sft"]["success"]]
    print("  no RL tenant ends below its own SFT result" if not fell else
          f"  RL ended below the SFT result: {', '.join(fell)}")
    print("\nservices (busy / wall):")
    print(f"  multi-tenant: wall {multi['wall_s']:.0f}s, training {multi['train_util']:.1%}, "
          f"inference {multi['infer_util']:.1%}")
    summary = {"multi": {k: v for k, v in multi.items() if k != "jobs"}, "results": multi["jobs"],
               "budget": dataclasses.asdict(budget), "backbone": args.backbone, "modules": module}
    if isolated:
        reduction = 1 - multi["wall_s"] / isolated["wall_s"]
        print(f"  isolated:     wall {isolated['wall_s']:.0f}s, training {isolated['train_util']:.1%}, "
              f"inference {isolated['infer_util']:.1%}")
        print(f"\ntime saved by running the tenants together: {isolated['wall_s'] - multi['wall_s']:.0f}s "
              f"of {isolated['wall_s']:.0f}s ({reduction:.1%})")
        summary["isolated"] = {k: v for k, v in isolated.items() if k != "jobs"}
        summary["reduction"] = reduction
    out = workdir / "summary.json"
    out.write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nper-step metrics: {workdir}/multi/<job>/metrics.csv; summary: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
