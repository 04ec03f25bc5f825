"""Fused heads benchmark: N tenants' same-architecture heads one after another vs as one call.

For N tenants (each its own gaussian head: 7-dim actions, horizon 8, 8-dim state) x local batch b,
on features the backbone computed once (two 32x32 cameras on the tiny preset by default), it times
in one run, interleaved, the head phase of a group as the model runner executes it:
  loop    every tenant's head in its own slot, one call each (vlamux's per-tenant path)
  fused   one call over the tenants' stacked parameters (vlamux.model.fused)
  limit   the plain head, independent of vlamux: one call of one head on a dense batch of N*b rows
          of a single shape, against N calls of b rows (`limit_speedup`; `of_limit` = speedup / it)
  vmap    (inference, --vmap) torch.func.vmap + functional_call over the same stacked parameters:
          the textbook way, measured for comparison
inference = sampling an action chunk; train = forward_backward (loss and gradients, applied to each
tenant's slot). Both contenders include the inputs' checks, the tenants' random draws, the
normalisation and the one host transfer of the results. Writes bench/results/fused_heads.json, cell
by cell (each (N, b) in both modes before the next; "partial" until the run ends: bench/common.py).

    python bench/fused_heads.py [--quick] [--preset tiny] [--device auto] [--dtype auto]
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ResultFile, add_cell_arguments, cell_key, cell_plan, environment,  # noqa: E402
                    interleaved_medians, plain_heads, print_table)

from vlamux.model import ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, Sample, build_backbone  # noqa: E402
from vlamux.model.backbones import spec_from_arg  # noqa: E402
from vlamux.model.device import add_device_arguments, parse_device_arguments  # noqa: E402
from vlamux.model.fused import stack_bucket  # noqa: E402
from vlamux.model.synthetic import TaskProfile, make_batch  # noqa: E402

FULL_GRID = [(n, b) for n in (1, 2, 4, 8, 16) for b in (1, 4)]
QUICK_GRID = [(1, 1), (8, 1), (8, 4)]
MODES = ("inference", "train")
TEMPLATES = ["pick up the {color} block", "push {color} cube away", "touch the {color} ball", "grab {color} box now"]


def build_cell(backbone, n: int, b: int, kind: str):
    """A runner with n tenants of one head architecture, their requests' features computed once."""
    runner = ModelRunner(backbone)
    g = torch.Generator().manual_seed(100 * n + b)
    data = []
    for i in range(n):
        runner.create_slot(f"tenant{i}", HeadSpec(kind, action_dim=7, horizon=8, state_dim=8), OptimizerSpec(lr=1e-4),
                           seed=i)
        profile = TaskProfile({"agentview": (32, 32), "wrist": (32, 32)}, 7, 8, 8, TEMPLATES[i % 4])
        data.append((f"tenant{i}",) + make_batch(profile, b, g))
    canon = [backbone.prepare(obs) for _, obs, _ in data]
    with torch.no_grad():
        features = backbone.forward_group(canon)
    return runner, data, features


class _Sampler(torch.nn.Module):
    """A head's sampling as a module's forward, for functional_call."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, feature, state, noise):
        return self.head.sample(feature, state, noise=noise)["actions"]


def vmap_sampler(runner: ModelRunner, data, features):
    """Sampling with torch.func.vmap over functional_call: the tenants' parameters stacked, one head's
    code vmapped over them (features of one shape, as in this benchmark's cells)."""
    from torch.func import functional_call, stack_module_state, vmap

    slots = [runner.slot(t) for t, _, _ in data]
    params, buffers = stack_module_state([_Sampler(s.head) for s in slots])
    base = _Sampler(copy.deepcopy(slots[0].head)).to("meta")
    meta = features[0].meta

    def one(p, b, h, m, t, state, eps):
        from vlamux.model.feature import VLAFeature

        return functional_call(base, (p, b), (VLAFeature(h, m, t, meta), state, {"eps": eps}))

    def sample():
        states = [s.sample_inputs(f, s.check_rows(f.batch_size, obs.state))[1]
                  for s, f, (_, obs, _) in zip(slots, features, data)]
        noises = [s.draw("sample", f.batch_size) for s, f in zip(slots, features)]
        bucket = stack_bucket(features, states, noises)  # padded to one shape, as the fused path does
        f = bucket.feature
        with torch.no_grad(), runner.lane.autocast(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no batching rule for scaled_dot_product_attention": measured as is
            actions = vmap(one)(params, buffers, f.hidden, f.mask, f.token_type, bucket.state, bucket.noise["eps"])
        return runner.lane.to_host([s.finish_sample({"actions": a[:n]})["actions"]
                                    for s, a, n in zip(slots, actions, bucket.rows)])

    return sample


def plain_limit(backbone, head, n: int, b: int, mode: str) -> dict:
    """The limit of fusing, apart from vlamux: a copy of one head, one call on N*b rows of one shape
    (features the backbone computed once) against N calls of b rows each."""
    profile = TaskProfile({"agentview": (32, 32), "wrist": (32, 32)}, 7, 8, 8, TEMPLATES[0])
    g = torch.Generator().manual_seed(11 * n + b)
    obs, actions = make_batch(profile, n * b, g)
    with torch.no_grad():
        dense = backbone(backbone.prepare(obs))
        parts = [backbone(backbone.prepare(make_batch(profile, b, g)[0])) for _ in range(n)]
    dev = backbone.device
    state = torch.randn(n * b, 8, generator=g).to(dev)
    work = plain_heads([copy.deepcopy(head)], mode, state, actions.to(dev))
    return {"dense_one": lambda: work(0, dense, slice(0, n * b)),
            "dense_split": lambda: [work(0, p, slice(i * b, (i + 1) * b)) for i, p in enumerate(parts)]}


def measure_cell(backbone, n: int, b: int, mode: str, kind: str, repeats: int, min_seconds: float,
                 with_vmap: bool) -> dict:
    runner, data, features = build_cell(backbone, n, b, kind)
    if mode == "inference":
        reqs = [Sample(t, obs) for t, obs, _ in data]
    else:
        reqs = [ForwardBackward(t, obs, act) for t, obs, act in data]

    def heads(fuse: bool):
        def go():
            for r in runner.run_heads(reqs, features, fuse=fuse):
                r.unwrap()
        return go

    contenders = {"loop": heads(False), "fused": heads(True),
                  **plain_limit(backbone, runner.slot(data[0][0]).head, n, b, mode)}
    if with_vmap and mode == "inference" and kind == "gaussian":
        contenders["vmap"] = vmap_sampler(runner, data, features)
    for fn in contenders.values():  # warm-up: allocator, caches of stacked parameters
        fn()
        fn()
    t = interleaved_medians(contenders, repeats, str(backbone.device), min_seconds)
    speedup, limit = t["loop"] / t["fused"], t["dense_split"] / t["dense_one"]
    cell = {"n_tenants": n, "local_batch": b, "mode": mode, "head": kind, "loop_s": t["loop"],
            "fused_s": t["fused"], "speedup": speedup, "limit_speedup": limit, "of_limit": speedup / limit,
            "dense_split_s": t["dense_split"], "dense_one_s": t["dense_one"]}
    if "vmap" in t:
        cell.update(vmap_s=t["vmap"], vmap_speedup=t["loop"] / t["vmap"])
    return cell


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="cells 1x1, 8x1, 8x4: under a minute")
    ap.add_argument("--preset", "--backbone", dest="preset", default="tiny", metavar="PRESET_OR_DIR",
                    help="the backbone the features come from: a built-in preset or a model directory")
    ap.add_argument("--head", default="gaussian", choices=["gaussian", "bins", "flow", "l1_chunk"])
    ap.add_argument("--vmap", action="store_true", help="also time torch.func.vmap (inference, gaussian head)")
    add_cell_arguments(ap, "fused_heads", "1; --quick 0.3")
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)
    grid, repeats, min_s = cell_plan(args, (QUICK_GRID, FULL_GRID), (5, 9), (0.3, 1.0))
    backbone = build_backbone(spec_from_arg(args.preset), device=device, dtype=dtype)
    env = environment(backbone.device, backbone.dtype)  # as built, not as asked
    print(f"fused heads: {args.head} heads on {args.preset} features, device={device}, dtype={env['dtype']}, "
          f"threads={env['threads']}, repeats={repeats}", flush=True)
    result = ResultFile("fused_heads_quick.json" if args.quick else "fused_heads.json", args.out,
                        [cell_key(mode, n, b) for n, b in grid for mode in MODES], cells=[],
                        config={"preset": args.preset, "head": args.head, "repeats": repeats, "min_seconds": min_s,
                                **env})
    cells = result.payload["cells"]
    for n, b in grid:  # each cell in both modes before the next: a run cut short keeps whole cells
        for mode in MODES:
            cell = measure_cell(backbone, n, b, mode, args.head, repeats, min_s, args.vmap)
            cell.update(preset=args.preset, device=str(device), dtype=env["dtype"])
            result.cell(cell_key(mode, n, b), cell)
            extra = f", vmap {cell['vmap_speedup']:.2f}x" if "vmap_speedup" in cell else ""
            print(f"  {mode:9s} N={n:2d} b={b}: loop {cell['loop_s'] * 1e3:7.2f} ms  fused {cell['fused_s'] * 1e3:7.2f} "
                  f"ms  -> {cell['speedup']:.2f}x (limit {cell['limit_speedup']:.2f}x){extra}", flush=True)
    print()
    columns = [("mode", "s"), ("n_tenants", "d"), ("local_batch", "d"), ("loop_s", ".5f"), ("fused_s", ".5f"),
               ("speedup", ".2f"), ("limit_speedup", ".2f"), ("of_limit", ".2f")]
    print_table(sorted(cells, key=lambda c: MODES.index(c["mode"])), columns)
    path = result.finish()
    target = next((c for c in cells if c["mode"] == "inference" and c["n_tenants"] == 8 and c["local_batch"] == 1),
                  None)
    if target:
        print(f"\n8 tenants x b=1, inference: fused {target['speedup']:.2f}x the per-tenant loop (target >= 2 on a CPU)")
    worst = min(c["of_limit"] for c in cells)
    print(f"worst cell: speedup = {worst:.2f} x limit_speedup (target >= 0.90); lowest speedup "
          f"{min(c['speedup'] for c in cells):.2f} (target >= 0.97)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
