"""Which bins-head recipe clones the main job's task best within its budget: the main job's
bins tenant (demonstrations, head, learning rate, evaluation) with 256 or 64 bins per action
dimension, with or without a LoRA adapter, SFT only, all at once on one set of services.

    python scripts/experiments/bins_recipe.py [--workdir runs/bins_recipe] [--out bench/results/bins_recipe.json]

A job whose checkpoint says its SFT is done is evaluated again, not retrained (the evaluation's
seeds are fixed, so it gives the same figure).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vlamux.experiments.multi_tenant import Budget, _runtime, _watch, ensure_demos, job_specs
from vlamux.jobs.master import MasterService

# name: (head options, LoRA adapter?, SFT steps)
VARIANTS = {"bins256-lora-2000": ({}, True, 2000), "bins64-lora-1000": ({"n_bins": 64}, True, 1000),
            "bins64-frozen-1000": ({"n_bins": 64}, False, 1000)}


def specs(budget: Budget, dataset) -> list[dict]:
    base = next(s for s in job_specs(budget, dataset, "tiny-tabletop") if s["tenant"] == "rl-bins-ppo")
    out = []
    for name, (options, lora, steps) in VARIANTS.items():
        head = {k: v for k, v in base["head"].items() if k not in ("adapter", "options")}
        head.update(options=options, **({"adapter": base["head"]["adapter"]} if lora else {}))
        out.append({"name": name, "tenant": name, "kind": "sft", "backbone": base["backbone"], "head": head,
                    "optimizer": base["optimizer"], "sft": {**base["sft"], "steps": steps, "warmup_steps": 100},
                    "eval": {**base["eval"], "before": False}, "checkpoint_every": 1000})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="runs/bins_recipe")
    ap.add_argument("--data", default="data/demos")
    ap.add_argument("--out", default="bench/results/bins_recipe.json")
    args = ap.parse_args(argv)
    budget = Budget()
    all_specs = specs(budget, ensure_demos(budget, args.data))
    rt = _runtime("tiny-tabletop")
    t0 = time.time()
    try:
        master = MasterService(rt, args.workdir)
        jobs = [master.submit(s) for s in all_specs]
        _watch(jobs, None, 3 * 3600)
    finally:
        rt.stop()
    rows = {}
    for j in jobs:
        if j.state != "succeeded":
            print(f"{j.spec.name}: {j.state} {j.error}", file=sys.stderr)
            return 1
        after = j.result["after"]
        rows[j.spec.name] = {"success": after["success"], "ci95": after["ci95"],
                             "episodes": sum(t["episodes"] for t in after["tasks"].values()),
                             "spec": j.spec.to_dict()}
        print(f"{j.spec.name:20s} {after['success']:.0%} [{after['ci95'][0]:.0%}, {after['ci95'][1]:.0%}]")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"what": "bins-head recipes for the main job's task, SFT only (50 seeded "
                                                  "episodes each)", "command": "python scripts/experiments/"
                                          "bins_recipe.py " + " ".join(argv or sys.argv[1:]),
                                          "wall_s": time.time() - t0, "variants": rows}, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
