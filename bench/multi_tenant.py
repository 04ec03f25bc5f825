"""The JoyNexus experiment on this machine: the 3 RL + 1 SFT workload of the main job run (a)
isolated — one tenant after another, each with fresh services to itself — and (b) multi-tenant —
all at once on one set of services — in one run. Reports each mode's wall time (the device time the
tenants hold), the Training and Inference Model Services' utilisation (busy / wall) and the
reduction 1 - multi / isolated. Evaluation is left out: this measures the training workload.

    python bench/multi_tenant.py [--quick]
Writes bench/results/multi_tenant.json (quick runs: multi_tenant_quick.json), rewritten as each run
(a mode in a setting) finishes: "partial", with the finished runs' figures under "runs", until the
run ends (bench/common.py's ResultFile).
Targets (the paper's): reduction >= 0.283, training utilisation >= 1.99x the isolated figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vlamux.model.memory import high_water  # noqa: E402
from common import AllocatorPeaks, ResultFile, cpu_seconds, environment, print_table, split_cores  # noqa: E402
from vlamux.experiments.multi_tenant import Budget, ensure_demos, job_specs, run  # noqa: E402
from vlamux.model.device import add_device_arguments, dtype_name, parse_device_arguments  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny budget: under a minute")
    ap.add_argument("--data", default="data/demos")
    ap.add_argument("--sft-steps", type=int, default=None, help="default 600 (--quick: the quick budget's)")
    ap.add_argument("--warm-start-steps", type=int, default=None, help="each RL tenant's SFT before RL (default 100)")
    ap.add_argument("--rl-env-steps", type=int, default=None, help="default 8000")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per op, the same in both modes")
    ap.add_argument("--demos", type=int, default=None, help="scripted episodes in the SFT dataset")
    ap.add_argument("--backbone", default="tiny", metavar="PRESET_OR_DIR", help="a preset or a model directory")
    ap.add_argument("--tenants", type=int, default=None, choices=range(2, 5), metavar="{2,3,4}",
                    help="the workload's first N tenants (default all 4: flow SFT, Gaussian PPO, bins PPO, "
                         "Gaussian GRPO; the device check's dry run takes 2)")
    ap.add_argument("--demo-cameras", choices=("video", "image"), default="video",
                    help="dataset frames as mp4 (needs PyAV) or PNG")
    ap.add_argument("--placement", choices=("shared", "split", "both"), default="both",
                    help="shared cores, the papers' split (services on a quarter of the cores, simulators on the "
                         "rest: one each on two), or both, interleaved (the split's figures: the result's `split`)")
    ap.add_argument("--no-priority", action="store_true",
                    help="inference and training at the same OS/CUDA priority (default: inference first)")
    ap.add_argument("--out", default=None)
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)
    import torch

    torch.set_num_threads(args.threads)
    # RL-heavy, like the paper's workload: RL tenants mostly simulate, SFT mostly trains
    budget = (Budget.quick() if args.quick else Budget(sft_steps=600, warm_start_steps=100, rl_env_steps=8000)).joynexus()
    given = {"sft_steps": args.sft_steps, "warm_start_steps": args.warm_start_steps,
             "rl_env_steps": args.rl_env_steps, "demos": args.demos}
    budget = dataclasses.replace(budget, demo_cameras=args.demo_cameras,
                                 **{k: v for k, v in given.items() if v is not None})
    dataset = ensure_demos(budget, args.data)
    specs = [{**s, "eval": None} for s in job_specs(budget, dataset, args.backbone)][:args.tenants]
    print(f"multi-tenant workload: {len(specs)} tenants ({', '.join(s['tenant'] for s in specs)}); "
          f"SFT {budget.sft_steps} steps, RL warm start {budget.warm_start_steps} steps + {budget.rl_env_steps} "
          f"env steps each; model services on {device} ({dtype_name(dtype)})", flush=True)
    settings = ["shared", "split"] if args.placement == "both" else [args.placement]
    # interleaved: each mode in both settings before the next mode
    order = [(mode, setting) for mode in ("isolated", "multi") for setting in settings]
    result = ResultFile("multi_tenant_quick.json" if args.quick else "multi_tenant.json", args.out,
                        [f"{setting} {mode}" for mode, setting in order], runs={},
                        budget=dataclasses.asdict(budget), environment=environment(device, dtype))
    with tempfile.TemporaryDirectory() as tmp, AllocatorPeaks(device) as pools:
        rows: dict = {s: {} for s in settings}
        for mode, setting in order:
            cpu0 = cpu_seconds()
            r = run(specs, mode, tmp, backbone=args.backbone, device=str(device), dtype=dtype_name(dtype),
                    placement={**(split_cores() if setting == "split" else {}),
                               "prioritize_inference": not args.no_priority}, label=f"{setting}-{mode}")
            r["cpu_util"] = (cpu_seconds() - cpu0) / (r["elapsed_s"] * (os.cpu_count() or 1))
            rows[setting][mode] = r
            result.payload["runs"].setdefault(setting, {})[mode] = {
                k: r[k] for k in ("wall_s", "elapsed_s", "train_util", "infer_util", "cpu_util", "busy_s",
                                  "device", "dtype", "memory") if k in r}
            result.mark(f"{setting} {mode}")
            print(f"  {setting:6s} {mode:8s}: wall {r['wall_s']:6.1f}s  training util {r['train_util']:.1%}  "
                  f"inference util {r['infer_util']:.1%}  CPU busy {r['cpu_util']:.0%}", flush=True)
    sections = {s: {**summarize(rows[s], budget, device, dtype, pools, s), "prioritize_inference": not args.no_priority}
                for s in settings}
    payload = dict(sections[settings[0]])
    if "split" in sections:
        payload["split"] = sections["split"]
    path = result.finish(payload)
    print(f"wrote {path}")
    return 0


def summarize(rows: dict, budget, device, dtype, pools, setting: str) -> dict:
    """One setting's figures: the reduction, the utilisation ratio, and the limit of the reduction
    from the same run: the model services' idle share of the isolated runs (grouping can at best
    fill that idle time)."""
    iso, multi = rows["isolated"], rows["multi"]
    reduction = 1 - multi["wall_s"] / iso["wall_s"]
    train_ratio = multi["train_util"] / max(iso["train_util"], 1e-9)
    print()
    print_table([{"mode": m, "wall_s": r["wall_s"], "train_util": r["train_util"], "infer_util": r["infer_util"],
                  "cpu_util": r["cpu_util"]} for m, r in rows.items()],
                [("mode", "s"), ("wall_s", ".1f"), ("train_util", ".3f"), ("infer_util", ".3f"), ("cpu_util", ".2f")])
    # both services share the services' cores (split) or every core (shared): their busy share of the
    # isolated wall time, at most 1; what is left is idle time a multi-tenant run could fill
    busy = iso["busy_s"]["training"] + iso["busy_s"]["inference"]
    idle_fraction = max(0.0, 1.0 - busy / iso["wall_s"])
    # the split's services' cores are also where this process's other threads run (workflows,
    # dataset decoding, the environment service's calls): their share left idle while the isolated
    # jobs ran, from CPU time, bounds what any schedule of the same work there can reclaim
    cores_idle = None
    if setting == "split":
        n = len(split_cores()["service_cpus"])
        cores_idle = max(0.0, 1.0 - iso["process_cpu_s"] / (iso["wall_s"] * n))
        print(f"[split] the services' cores were idle {cores_idle:.3f} of the isolated runs (CPU time)")
    print(f"\n[{setting}] reduction {reduction:.3f} (target >= 0.283 or >= 0.9 x the isolated runs' idle fraction "
          f"{idle_fraction:.3f}: {'met' if reduction >= min(0.283, 0.9 * idle_fraction) else 'NOT met'}); "
          f"training utilisation {train_ratio:.2f}x isolated (target >= 1.99x: "
          f"{'met' if train_ratio >= 1.99 else 'NOT met'})")
    payload = {"isolated_wall_s": iso["wall_s"], "multi_wall_s": multi["wall_s"], "reduction": reduction,
               "train_util_isolated": iso["train_util"], "train_util_multi": multi["train_util"],
               "infer_util_isolated": iso["infer_util"], "infer_util_multi": multi["infer_util"],
               "train_util_ratio": train_ratio, "cpu_util_isolated": iso["cpu_util"], "cpu_util_multi": multi["cpu_util"],
               "per_job": {m: {n: {k: v for k, v in j.items() if k in ("wall_s", "policy_version")}
                               for n, j in r["jobs"].items()} for m, r in rows.items()},
               "budget": dataclasses.asdict(budget), "environment": environment(device, dtype),
               # read by each run while its services' pools existed (the peak counters span the whole run)
               "memory": high_water([r.get("memory", {}) for r in rows.values()]),
               "placement": {"device": multi["device"], "dtype": multi["dtype"],  # as the services ran
                             **({k: list(v) for k, v in split_cores().items()} if setting == "split"
                                else {"cores": "shared"})},
               "idle_fraction_isolated": idle_fraction, "busy_s_isolated": iso["busy_s"],
               "service_cores_idle_isolated": cores_idle,
               "process_cpu_s": {m: r["process_cpu_s"] for m, r in rows.items()},
               # a service is at most busy all the time: the ratio cannot pass 1 / its isolated utilisation
               "train_util_ratio_bound": 1.0 / max(iso["train_util"], 1e-9),
               "train_util_ratio_of_bound": train_ratio * max(iso["train_util"], 1e-9),
               "reduction_of_idle": reduction / max(idle_fraction, 1e-9)}
    return payload


if __name__ == "__main__":
    sys.exit(main())
