"""Group batching benchmark: serial per-tenant execution vs one grouped execution.

For N tenants (heads cycling l1_chunk, flow, gaussian, bins) x local batch b,
on the `small` preset with two 128x128 cameras and ~20-token instructions, it
times in one run, interleaved:
  inference  serial: N x (canonicalise + backbone + head sample)
             grouped: canonicalise N + one backbone forward + N head samples
  train      the same with forward_backward, plus every tenant's optimizer step
  limit      the plain model, independent of vlamux's group path: one dense batch of N*b rows of a
             single shape through the backbone, then each tenant's head on its b rows, against N
             calls of (backbone, head) on b rows each (`limit_speedup`)
  packed     the backbone's own group path (`forward_group`, packed tokens) on the tenants' own
             batches vs N raw backbone calls (`packed_speedup`, the old "limit")
with the runner's group cap learned from this hardware (`ModelRunner.calibrate`; `--no-cap`: none),
and writes bench/results/group_batching.json ({"cells": [...], "config": ...}); on a transformers VLM
(--backbone DIR) group_batching_hf.json, the same cells. Each (N, b) cell runs in both modes before the
next, in the order given, and the file is rewritten after each (bench/common.py's ResultFile: "partial"
until the run ends), so a run cut short keeps the cells it finished.

    python bench/group_batching.py            # full grid, N, b in {1, 2, 4, 8}
    python bench/group_batching.py --quick    # reduced grid, under a minute
    python bench/group_batching.py --backbone DIR   # an hf model directory (vlamux backbone init ...)
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ResultFile, add_cell_arguments, cell_key, cell_plan, environment,  # noqa: E402
                    interleaved_medians, plain_model, print_table)

from vlamux.model import ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, Sample, build_backbone
from vlamux.model.backbones import spec_from_arg
from vlamux.model.device import add_device_arguments, parse_device_arguments
from vlamux.model.synthetic import TaskProfile, make_batch

HEAD_KINDS = ["l1_chunk", "flow", "gaussian", "bins"]
# ~20-token instructions (byte tokens incl. BOS/EOS) that differ a little in length across tenants.
TEMPLATES = ["pick up the {color} block", "push {color} cube away", "touch the {color} ball", "grab {color} box now"]
FULL_GRID = list(itertools.product([1, 2, 4, 8], [1, 2, 4, 8]))
QUICK_GRID = [(1, 1), (2, 1), (8, 1), (4, 2)]
MODES = ("inference", "train")


def build_cell(backbone, n_tenants: int, local_batch: int):
    runner = ModelRunner(backbone)
    data = []
    g = torch.Generator().manual_seed(n_tenants * 100 + local_batch)
    for i in range(n_tenants):
        kind = HEAD_KINDS[i % len(HEAD_KINDS)]
        spec = HeadSpec(kind, action_dim=7, horizon=8, state_dim=8)
        runner.create_slot(f"tenant{i}", spec, OptimizerSpec(lr=1e-4), seed=i)
        profile = TaskProfile({"agentview": (128, 128), "wrist": (128, 128)}, 7, 8, 8, TEMPLATES[i % 4])
        obs, actions = make_batch(profile, local_batch, g)
        data.append((f"tenant{i}", obs, actions))
    return runner, data


def measure_cell(backbone, n: int, b: int, mode: str, repeats: int, min_seconds: float, device: str,
                 curves: dict | None = None) -> dict:
    runner, data = build_cell(backbone, n, b)
    if curves:
        runner.group_curves.update(curves)  # the cap learned once for this backbone and device
    if mode == "inference":  # stochastic sampling: flow runs its K Euler steps, bins/gaussian draw
        reqs = [Sample(t, obs) for t, obs, _ in data]
    else:
        reqs = [ForwardBackward(t, obs, act) for t, obs, act in data]

    def run(grouped: bool):
        def go():
            results = runner.execute(reqs, grouped=grouped)
            for r in results:
                r.unwrap()
            if mode == "train":
                for t, _, _ in data:
                    runner.optim_step(t).unwrap()
            return results
        return go

    canon = [backbone.prepare(obs) for _, obs, _ in data]  # each request as the backbone takes it

    @torch.no_grad()
    def raw_separate():
        for c in canon:
            backbone(c)

    @torch.no_grad()
    def raw_concat():  # the same rows in one backbone pass, as the backbone runs a group (packed tokens)
        backbone.forward_group(canon)

    contenders = {"serial": run(False), "grouped": run(True), "raw_separate": raw_separate, "raw_concat": raw_concat,
                  **plain_model(backbone, [runner.slot(t).head for t, _, _ in data], b, mode,
                                TaskProfile({"agentview": (128, 128), "wrist": (128, 128)}, 7, 8, 8, TEMPLATES[0]))}
    for fn in contenders.values():  # warm-up: allocator, kernels, lazy init
        fn()
    t = interleaved_medians(contenders, repeats, device, min_seconds)
    out = run(True)()
    head_s = sum(r.head_s for r in out)
    speedup = t["serial"] / t["grouped"]
    limit = t["dense_split"] / t["dense_one"]
    cap = runner.group_curves[backbone.backbone_id].cap if backbone.backbone_id in runner.group_curves else None
    return {
        "n_tenants": n, "local_batch": b, "mode": mode,
        "serial_s": t["serial"], "grouped_s": t["grouped"], "speedup": speedup,
        "limit_speedup": limit, "of_limit": speedup / limit,
        "packed_speedup": t["raw_separate"] / t["raw_concat"],
        "dense_split_s": t["dense_split"], "dense_one_s": t["dense_one"],
        "raw_separate_s": t["raw_separate"], "raw_concat_s": t["raw_concat"],
        "group_cap_rows": cap, "largest_group": max(r.group_size for r in out),
        "head_fraction": min(1.0, head_s / t["grouped"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced grid (includes N=8, b=1), under a minute")
    ap.add_argument("--preset", default="small", help="built-in preset (when --backbone is not given)")
    ap.add_argument("--backbone", default=None, metavar="PRESET_OR_DIR",
                    help="a built-in preset or a model directory (a transformers VLM; see `vlamux backbone init`)")
    ap.add_argument("--no-cap", action="store_true", help="groups uncapped (no calibration)")
    add_device_arguments(ap)
    add_cell_arguments(ap, "group_batching", "1.5; --quick 0.5")
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)

    grid, repeats, min_s = cell_plan(args, (QUICK_GRID, FULL_GRID), (3, 5), (0.5, 1.5))
    backbone = build_backbone(spec_from_arg(args.backbone or args.preset), device=device, dtype=dtype)
    env = environment(backbone.device, backbone.dtype)  # as built, not as asked
    label = backbone.backbone_id if backbone.kind == "hf" else args.preset
    print(f"group batching: backbone={label} ({backbone.num_parameters() / 1e6:.1f}M params), "
          f"device={device}, dtype={env['dtype']}, threads={env['threads']}, repeats={repeats}, "
          f"cells={len(grid) * 2}", flush=True)
    stem = "group_batching_hf" if backbone.kind == "hf" else "group_batching"
    family = backbone.describe().get("family", "builtin")
    config = {"preset": label, "backbone": family, "repeats": repeats, "min_seconds": min_s, "group_cap": None, **env}
    result = ResultFile(f"{stem}_quick.json" if args.quick else f"{stem}.json", args.out,
                        [cell_key(mode, n, b) for n, b in grid for mode in MODES], cells=[], config=config)
    curves = None
    if not args.no_cap:
        curves = ModelRunner(backbone).calibrate()
        c = curves[backbone.backbone_id]
        config["group_cap"] = c.describe()
        print(f"learned group cap: {c.cap} rows ({c.reason}); curve "
              + ", ".join(f"{r}: {s * 1e3:.1f} ms" for r, s in zip(c.rows, c.seconds)), flush=True)
    cells = result.payload["cells"]
    for n, b in grid:  # each cell in both modes before the next: a run cut short keeps whole cells
        for mode in MODES:
            cell = measure_cell(backbone, n, b, mode, repeats, min_s, str(device), curves)
            cell.update(preset=label, backbone=family, device=str(device), dtype=env["dtype"])
            result.cell(cell_key(mode, n, b), cell)
            print(f"  {mode:9s} N={n} b={b}: speedup {cell['speedup']:.2f}x, limit {cell['limit_speedup']:.2f}x, "
                  f"packed {cell['packed_speedup']:.2f}x", flush=True)
    print()
    print_table(sorted(cells, key=lambda c: MODES.index(c["mode"])),
                [("mode", "s"), ("n_tenants", "d"), ("local_batch", "d"), ("serial_s", ".3f"),
                 ("grouped_s", ".3f"), ("speedup", ".2f"), ("limit_speedup", ".2f"), ("of_limit", ".2f"),
                 ("packed_speedup", ".2f"), ("head_fraction", ".2f")])
    path = result.finish()
    worst = min(c["of_limit"] for c in cells)
    slowest = min(c["speedup"] for c in cells)
    print(f"\nworst cell: speedup = {worst:.2f} x limit_speedup (target >= 0.90); lowest speedup {slowest:.2f} "
          f"(target >= 0.97: never clearly slower than serial)")
    for mode in ("inference", "train"):
        c = next((c for c in cells if c["mode"] == mode and c["n_tenants"] == 8 and c["local_batch"] == 1), None)
        if c:
            print(f"8 tenants x b=1 {mode}: {c['speedup']:.2f}x grouped vs serial (limit {c['limit_speedup']:.2f}x; "
                  f"JoyNexus reports 3.24x on GPU)")
    print(f"wrote {path}  ({env['processor']}, torch {env['torch']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
