"""The model-core demo: several tenants, different heads, one shared frozen backbone, grouped.

Each tenant trains its own head on procedural reaching data (vlamux.model.synthetic)
through grouped forward_backward + optimizer steps; the demo prints
per-tenant losses as they fall, each tenant's action error before and after
training, and the time of grouped vs serial execution of the same steps.

    python -m vlamux.demo [--steps 300] [--preset tiny] [--batch 16] [--device auto] [--dtype auto]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from vlamux.model import ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, Sample, build_backbone
from vlamux.model.backbones import spec_from_arg
from vlamux.model.device import add_device_arguments, dtype_name, parse_device_arguments
from vlamux.model.synthetic import TaskProfile, make_batch

TENANTS = {
    "acme-l1": (HeadSpec("l1_chunk", 4, 8, 4),
                TaskProfile({"top": (64, 64)}, 4, 8, 4, "reach the {color} block")),
    "bolt-flow": (HeadSpec("flow", 3, 6, 4, options={"steps": 8}),
                  TaskProfile({"top": (48, 48), "wrist": (32, 32)}, 3, 6, 4, "please move over to the {color} block")),
    "cobalt-gauss": (HeadSpec("gaussian", 4, 8, 4),
                     TaskProfile({"top": (40, 56)}, 4, 8, 4, "{color}")),
    "delta-bins": (HeadSpec("bins", 5, 4, 4, options={"n_bins": 64}),
                   TaskProfile({"top": (32, 32), "wrist": (64, 64)}, 5, 4, 4, "go to {color}")),
}


def action_error(runner: ModelRunner, eval_data: dict) -> dict[str, float]:
    """Mean absolute error of each tenant's deterministic action chunk against the expert's."""
    reqs = [Sample(t, obs, deterministic=True) for t, (obs, _) in eval_data.items()]
    return {r.tenant: (r.unwrap()["actions"] - eval_data[r.tenant][1]).abs().mean().item()
            for r in runner.execute(reqs)}


def train_steps(runner: ModelRunner, batches: list[dict], grouped: bool) -> list[dict[str, float]]:
    losses = []
    for data in batches:
        results = runner.execute([ForwardBackward(t, obs, act) for t, (obs, act) in data.items()], grouped=grouped)
        losses.append({r.tenant: r.unwrap()["loss"] for r in results})
        for t in data:
            runner.optim_step(t).unwrap()
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="rows per tenant per step")
    ap.add_argument("--preset", default="tiny", help="built-in backbone preset: tiny, small, base, xl")
    ap.add_argument("--backbone", default=None, metavar="PRESET_OR_DIR",
                    help="the shared backbone: a preset, or a model directory (a transformers VLM); "
                         "default: --preset")
    ap.add_argument("--timing-steps", type=int, default=6)
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)
    torch.manual_seed(0)

    try:
        spec = spec_from_arg(args.backbone or args.preset)
    except ValueError as e:
        ap.error(str(e))
    backbone = build_backbone(spec, device=device, dtype=dtype)
    runner = ModelRunner(backbone)
    for i, (name, (spec, _)) in enumerate(TENANTS.items()):
        runner.create_slot(name, spec, OptimizerSpec(lr=1e-3 if spec.kind != "flow" else 5e-4), seed=i)
    print(f"backbone {backbone.backbone_id}: {backbone.num_parameters() / 1e6:.2f}M frozen parameters on "
          f"{backbone.device} ({dtype_name(backbone.dtype)}), shared by {len(TENANTS)} tenants")
    for name, (spec, prof) in TENANTS.items():
        cams = ", ".join(f"{c} {h}x{w}" for c, (h, w) in prof.cameras.items())
        print(f"  {name:13s} head={spec.kind:9s} actions {spec.horizon}x{spec.action_dim}  cameras: {cams}")

    g = torch.Generator().manual_seed(1234)
    eval_data = {t: make_batch(p, 64, g) for t, (_, p) in TENANTS.items()}
    before = action_error(runner, eval_data)

    print(f"\ntraining {args.steps} grouped steps, {args.batch} rows per tenant per step")
    t0 = time.perf_counter()
    window: dict[str, list[float]] = {t: [] for t in TENANTS}
    for step in range(1, args.steps + 1):
        data = {t: make_batch(p, args.batch, g) for t, (_, p) in TENANTS.items()}
        for t, loss in train_steps(runner, [data], grouped=True)[0].items():
            window[t].append(loss)
        if step % max(1, args.steps // 10) == 0 or step == args.steps:
            cols = "  ".join(f"{t}={statistics.fmean(v):.4f}" for t, v in window.items())
            print(f"  step {step:4d}  {time.perf_counter() - t0:6.1f}s  loss: {cols}", flush=True)
            window = {t: [] for t in TENANTS}
    after = action_error(runner, eval_data)

    print("\naction error (mean |a - expert|, held-out batch):")
    for t in TENANTS:
        print(f"  {t:13s} before {before[t]:.4f}  after {after[t]:.4f}  ({after[t] / before[t]:.2f}x)")

    # Same state, same batches, run once grouped and once serially.
    batches = [{t: make_batch(p, args.batch, g) for t, (_, p) in TENANTS.items()} for _ in range(args.timing_steps)]
    times = {}
    for grouped in (True, False, True, False):
        twin = ModelRunner(list(runner.backbones.values()))  # the same resident backbone, copies of the slots
        for slot in runner.slots.values():
            twin.add_slot(copy.deepcopy(slot))
        start = time.perf_counter()
        train_steps(twin, batches, grouped)
        times.setdefault(grouped, []).append(time.perf_counter() - start)
    g_s, s_s = min(times[True]), min(times[False])
    print(f"\n{args.timing_steps} training steps of {len(TENANTS)} tenants: grouped {g_s:.2f}s, serial {s_s:.2f}s "
          f"-> {s_s / g_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
