"""LoRA in mixed groups: N tenants, each with its own LoRA adapter (rank 8 on the backbone's default
Linears), serial vs one mixed group, for inference and the training step; with the limit of grouping
measured by an independent path, in the same run, interleaved:

  serial     each tenant's base-plus-own-adapter pass alone (the runner, one request at a time)
  grouped    one mixed group: the base runs once over every row, each adapter on its own rows
  plain      the same group with no adapters (what `lora_overhead` compares against)
  limit      the plain model (the backbone module itself, no runner, no adapters) on one dense batch of
             N x b rows of one shape vs N calls of b rows; for the training step forward and backward
             (to the inputs: the frozen model's backward, as an adapter's gradient needs it)

Cells: n_tenants, local_batch, mode, serial_s, grouped_s, speedup, limit_speedup, of_limit,
lora_overhead (grouped with adapters / plain grouped - 1). Writes bench/results/lora_groups.json, cell
by cell (each (N, b) in both modes before the next; "partial" until the run ends: bench/common.py).

    python bench/lora_groups.py [--quick] [--backbone small|DIR] [--device auto] [--dtype auto]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ResultFile, add_cell_arguments, cell_key, cell_plan, environment,  # noqa: E402
                    interleaved_medians, print_table)

from vlamux.model import ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, Sample, build_backbone  # noqa: E402
from vlamux.model.backbones import spec_from_arg  # noqa: E402
from vlamux.model.calibrate import measured  # noqa: E402
from vlamux.model.device import add_device_arguments, parse_device_arguments  # noqa: E402
from vlamux.model.synthetic import TaskProfile, make_batch  # noqa: E402

FULL_GRID = [(n, b) for n in (1, 2, 4, 8) for b in (1, 4)]
QUICK_GRID = [(1, 1), (8, 1), (4, 4)]
MODES = ("inference", "train")
# One shape for every tenant (cameras, instruction length), so the limit's dense batch is the same rows.
PROFILE = TaskProfile({"agentview": (128, 128), "wrist": (128, 128)}, 7, 8, 8, "pick up the {color} block")


def build(backbone, n: int, b: int, lora: bool):
    runner = ModelRunner(backbone)
    curve = measured(backbone)  # the cap learned once for this backbone (main; none with --no-cap)
    if curve is not None:
        runner.group_curves[backbone.backbone_id] = curve
    adapter = {"rank": 8} if lora else None
    for i in range(n):
        runner.create_slot(f"tenant{i}", HeadSpec("gaussian", 7, 8, 8, width=64, depth=1, adapter=adapter),
                           OptimizerSpec(lr=1e-4), seed=i)
    g = torch.Generator().manual_seed(1000 * n + b)
    data = [(f"tenant{i}",) + make_batch(PROFILE, b, g) for i in range(n)]
    return runner, data


def measure_cell(backbone, n: int, b: int, mode: str, repeats: int, min_seconds: float) -> dict:
    lora, data = build(backbone, n, b, True)
    plain, _ = build(backbone, n, b, False)
    if mode == "inference":
        reqs = [Sample(t, obs, True) for t, obs, _ in data]
    else:
        reqs = [ForwardBackward(t, obs, act) for t, obs, act in data]

    def run(runner, grouped: bool):
        def go():
            for r in runner.execute(reqs, grouped=grouped):
                r.unwrap()
            if mode == "train":
                for t, _, _ in data:
                    runner.optim_step(t).unwrap()
        return go

    # the limit: the plain model, one dense batch vs N, with the inputs' preprocessing done beforehand
    from vlamux.model.batch import Observation

    parts = [backbone.prepare(obs) for _, obs, _ in data]
    dense = backbone.prepare(Observation({k: torch.cat([o.images[k] for _, o, _ in data]) for k in data[0][1].images},
                                         [s for _, o, _ in data for s in o.instruction]))

    def model(batches: list) -> None:
        if mode == "inference":
            with torch.no_grad():
                for x in batches:
                    backbone(x)
            return
        for x in batches:  # forward and backward through the frozen model, to its float inputs
            x = _with_grad(x)
            backbone(x).hidden.float().sum().backward()

    contenders = {"serial": run(lora, False), "grouped": run(lora, True), "plain": run(plain, True),
                  "limit_separate": lambda: model(parts), "limit_dense": lambda: model([dense])}
    for fn in contenders.values():
        fn()
    t = interleaved_medians(contenders, repeats, str(backbone.device), min_seconds)
    speedup, limit = t["serial"] / t["grouped"], t["limit_separate"] / t["limit_dense"]
    return {"n_tenants": n, "local_batch": b, "mode": mode, "serial_s": t["serial"], "grouped_s": t["grouped"],
            "speedup": speedup, "limit_speedup": limit, "of_limit": speedup / limit,
            "plain_grouped_s": t["plain"], "lora_overhead": t["grouped"] / t["plain"] - 1,
            "limit_separate_s": t["limit_separate"], "limit_dense_s": t["limit_dense"],
            "group_cap_rows": (lora.group_curves.get(backbone.backbone_id) or type("N", (), {"cap": None})).cap}


def _with_grad(batch):
    """The batch with its float inputs requiring grad (a backward then runs through every layer)."""
    import dataclasses

    if hasattr(batch, "pixels"):
        return dataclasses.replace(batch, pixels=batch.pixels.detach().requires_grad_())
    rows = [dataclasses.replace(r, extra={k: v.detach().float().requires_grad_() if v.is_floating_point() else v
                                          for k, v in r.extra.items()}) for r in batch.rows]
    return dataclasses.replace(batch, rows=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="cells 1x1, 8x1, 4x4 on the tiny preset: under a minute")
    ap.add_argument("--backbone", default=None, metavar="PRESET_OR_DIR", help="default small (--quick: tiny)")
    ap.add_argument("--no-cap", action="store_true", help="groups uncapped (no calibration)")
    add_cell_arguments(ap, "lora_groups", "1; --quick 0.3")
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)
    grid, repeats, min_s = cell_plan(args, (QUICK_GRID, FULL_GRID), (3, 5), (0.3, 1.0))
    backbone = build_backbone(spec_from_arg(args.backbone or ("tiny" if args.quick else "small")), device=device,
                              dtype=dtype)
    env = environment(backbone.device, backbone.dtype)
    config = {"backbone": backbone.backbone_id, "rank": 8, "repeats": repeats, "min_seconds": min_s,
              "group_cap": None, **env}
    result = ResultFile("lora_groups_quick.json" if args.quick else "lora_groups.json", args.out,
                        [cell_key(mode, n, b) for n, b in grid for mode in MODES], cells=[], config=config)
    if not args.no_cap:
        c = ModelRunner(backbone).calibrate()[backbone.backbone_id]  # kept in this process: every cell's runner
        config["group_cap"] = c.describe()
        print(f"learned group cap: {c.cap} rows ({c.reason})", flush=True)
    print(f"lora groups: {backbone.backbone_id} ({backbone.num_parameters() / 1e6:.1f}M params), device={device}, "
          f"dtype={env['dtype']}, threads={env['threads']}, repeats={repeats}", flush=True)
    cells = result.payload["cells"]
    for n, b in grid:  # each cell in both modes before the next: a run cut short keeps whole cells
        for mode in MODES:
            c = measure_cell(backbone, n, b, mode, repeats, min_s)
            c.update(backbone=backbone.backbone_id, device=str(device), dtype=env["dtype"])
            result.cell(cell_key(mode, n, b), c)
            print(f"  {mode:9s} N={n} b={b}: speedup {c['speedup']:.2f}x, limit {c['limit_speedup']:.2f}x "
                  f"({c['of_limit']:.2f} of it), lora overhead {c['lora_overhead']:+.0%}", flush=True)
    print()
    print_table(sorted(cells, key=lambda c: MODES.index(c["mode"])),
                [("mode", "s"), ("n_tenants", "d"), ("local_batch", "d"), ("serial_s", ".3f"),
                 ("grouped_s", ".3f"), ("speedup", ".2f"), ("limit_speedup", ".2f"), ("of_limit", ".2f"),
                 ("lora_overhead", ".2f")])
    worst = min(cells, key=lambda c: c["of_limit"])
    print(f"\nworst cell: {worst['mode']} {worst['n_tenants']}x{worst['local_batch']}, speedup = "
          f"{worst['of_limit']:.2f} x limit_speedup (target >= 0.90 in every cell)")
    path = result.finish()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
