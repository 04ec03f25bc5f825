"""Imported VLA tenants: serial per-tenant policy calls vs one grouped call, against the dense limit.

For SmolVLA- and π0-shaped policies (random weights, `vlamux.model.vla.synthetic`: the fixtures' tiny
sizes and a `small` shape of a few million parameters), N imported tenants (one checkpoint, each
tenant's expert then drawn apart) x local batch b, two cameras (64x64, 48x48), an 8-dim state, it
times in one run, interleaved, each timed call right after an untimed one of the same contender (the
runner's and the plain modules' weights are different memory: a call after the other kind's starts cold):
  inference  serial: N x (prefix through the VLM + ten flow steps of the tenant's expert)
             grouped: the N prefixes in one VLM forward, then each expert's ten steps on its rows
  train      the same with the flow-matching loss and backward, plus every tenant's optimizer step
  limit      plain modules, independent of vlamux's runner and backbone: a separate copy of the VLM and
             of each expert (vlamux.model.vla's modules, as the standalone policy runs them), one
             dense batch of N*b prefixes (one shape) then each expert on its rows ("dense_one"),
             against N calls of (prefix, expert) on b rows each ("dense_split"); limit = split / one
and writes bench/results/vla_groups.json: cells as group_batching's, plus `resident_bytes` (the
shared VLM once plus N experts, against N whole policies).

The ratios are paired by round: this machine's speed drifts in phases of seconds (the same call takes
37 ms, then 55-62 ms for ten calls, then 37 ms again), so speedup (serial/grouped), limit (split/one) and
of-limit are each formed from the four contenders' calls of one round (about a second apart), and the
cell reports the median over rounds, with its quartiles and every sample ("samples_s"); the ratio of
the contenders' separate medians is kept as "of_limit_of_medians". At N = 1 grouped and serial run the
same code, as do the two plain contenders, so those cells' of-limit is 1 plus the estimator's noise.
Run it with one thread per process (OMP_NUM_THREADS=1) on a 2-core machine: two OpenMP threads stall
together whenever anything else takes a core, which doubles that noise.

    python bench/vla_groups.py           # full grid: N in {1, 2, 4, 8, 16} x b in {1, 4}, both families, both shapes
    python bench/vla_groups.py --quick   # tiny shapes, a few cells
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, ResultFile, add_cell_arguments, cell_key, cell_plan, environment,  # noqa: E402
                    interleaved_samples, parse_models, plain_adamw, print_table)

from vlamux.model import ForwardBackward, ModelRunner, OptimizerSpec, Sample, build_backbone
from vlamux.model.backbones import BackboneSpec
from vlamux.model.batch import Observation
from vlamux.model.device import add_device_arguments, parse_device_arguments
from vlamux.model.vla import VLAPolicy
from vlamux.model.vla.flow import loss as flow_loss
from vlamux.model.vla.flow import sample as flow_sample
from vlamux.model.vla.synthetic import random_checkpoint
from vlamux.model.vla.vlm import prefix_inputs, prefix_kv

# the summary's cell (8 x 1) first: a run cut short keeps it
FULL_GRID = [(8, 1)] + [c for c in itertools.product([1, 2, 4, 8, 16], [1, 4]) if c != (8, 1)]
QUICK_GRID = [(1, 1), (8, 1), (4, 4)]
MODES = ("inference", "train")
MODELS = [("smolvla", "tiny"), ("pi0", "tiny"), ("smolvla", "small"), ("pi0", "small")]
TASK = "pick up the red cube"


def observation(b: int, g: torch.Generator) -> tuple[Observation, torch.Tensor]:
    images = {"front": torch.randint(0, 256, (b, 3, 64, 64), generator=g, dtype=torch.uint8),
              "wrist": torch.randint(0, 256, (b, 3, 48, 48), generator=g, dtype=torch.uint8)}
    return Observation(images, [TASK] * b, torch.randn(b, 8, generator=g)), torch.randn(b, 50, 7, generator=g)


class Plain:
    """The policy as plain modules (a VLM, N experts, plain fused AdamW), with no runner, backbone or slot."""

    def __init__(self, policy: VLAPolicy, experts: list, lr: float, device, dtype):
        self.p, self.experts, self.device, self.dtype = policy, experts, torch.device(device), dtype
        self.vlm = policy.vlm.to(self.device, dtype)
        self.opts = [plain_adamw(e.parameters(), lr) for e in experts]

    def _on(self, t: torch.Tensor, dtype=None) -> torch.Tensor:
        return t.to(self.device, dtype or t.dtype, non_blocking=True)

    def _prefix(self, tenants: list[int], data: list, grad: bool):
        """One VLM forward over the rows of `tenants` (the same prompt: one dense shape)."""
        p = self.p.processor
        obs = [data[i][0] for i in tenants]
        states = [self._on(p.pad(p.normalize_state(o.state), p.max_state)) for o in obs]
        images = {c: torch.cat([o.images[c] for o in obs]) for c in obs[0].images}
        ids, mask = p.tokens(p.prompts([t for o in obs for t in o.instruction], torch.cat([o.state for o in obs])))
        ids, mask = self._on(ids), self._on(mask)
        with torch.set_grad_enabled(grad):
            cams = [self.vlm.embed_images(self._on(x, self.dtype)) for x in p.images(images)]
            tokens = [self.experts[i].state_token(s) for i, s in zip(tenants, states)]
            own = None if tokens[0] is None else torch.cat(tokens)  # SmolVLA: each tenant's state token
            kv = prefix_kv(self.vlm, *prefix_inputs(cams, self.vlm.embed_text(ids), mask, own))
        return kv, states

    def run(self, tenants: list[int], data: list, mode: str, g: torch.Generator) -> None:
        p, train = self.p.processor, mode == "train"
        kv, states = self._prefix(tenants, data, grad=train and self.p.family == "smolvla")
        at, losses = 0, []
        for i, s in zip(tenants, states):
            obs, actions = data[i]
            b = obs.batch_size
            mine = kv.select(slice(at, at + b)).to(torch.float32)  # the experts run in fp32, as a slot's do
            at += b
            noise = self._on(torch.randn(b, p.chunk, p.max_action, generator=g))
            if not train:
                with torch.no_grad():
                    x = flow_sample(self.experts[i], mine, noise, s, self.p.steps)
                    x[..., :p.action_dim].to("cpu", non_blocking=True)  # the actions to the host, as a replica's
                continue
            a = self._on(p.pad(p.normalize_actions(actions), p.max_action))
            t = self._on(torch.rand(b, generator=g).pow(1 / 1.5) * 0.999 + 0.001)
            losses.append(flow_loss(self.experts[i], mine, a, noise, t, s, None))
        if train:
            torch.stack(losses).sum().backward()
            for i in tenants:  # as a slot steps: its gradients clipped to norm 1, then AdamW
                torch.nn.utils.clip_grad_norm_(self.experts[i].parameters(), 1.0)
                self.opts[i].step()
                self.opts[i].zero_grad(set_to_none=True)


def measure_cell(ckpt: Path, vlm_dir: Path, n: int, b: int, mode: str, repeats: int, min_s: float, device: str,
                 backbone) -> dict:
    runner = ModelRunner(backbone)
    g = torch.Generator().manual_seed(1000 * n + b)
    data, experts = [], []
    for i in range(n):  # one checkpoint; each tenant's expert then drawn apart
        slot = runner.import_lerobot(f"t{i}", ckpt, OptimizerSpec(lr=1e-5), seed=i)
        with torch.no_grad():
            for prm in slot.head.expert.parameters():
                prm.add_(0.02 * torch.randn(prm.shape, generator=g).to(prm))
        experts.append(copy.deepcopy(slot.head.expert))
        data.append(observation(b, g))
    plain = Plain(VLAPolicy(ckpt, vlm_dir), experts, 1e-5, backbone.device, backbone.dtype)
    reqs = [Sample(f"t{i}", o) for i, (o, _) in enumerate(data)] if mode == "inference" else \
        [ForwardBackward(f"t{i}", o, a) for i, (o, a) in enumerate(data)]

    def run(grouped: bool):
        def go():
            out = runner.execute(reqs, grouped=grouped)
            for r in out:
                r.unwrap()
            if mode == "train":
                for i in range(n):
                    runner.optim_step(f"t{i}").unwrap()
            return out
        return go

    pg = torch.Generator().manual_seed(7)
    contenders = {"serial": run(False), "grouped": run(True),
                  "dense_one": lambda: plain.run(list(range(n)), data, mode, pg),
                  "dense_split": lambda: [plain.run([i], data, mode, pg) for i in range(n)]}
    for fn in contenders.values():
        fn()
    samples = interleaved_samples(contenders, repeats, device, min_s, warm_each=True)
    t = {k: statistics.median(v) for k, v in samples.items()}
    rounds = [dict(zip(samples, r)) for r in zip(*samples.values())]
    speedups = [r["serial"] / r["grouped"] for r in rounds]
    limits = [r["dense_split"] / r["dense_one"] for r in rounds]
    of_limits = sorted(s / lim for s, lim in zip(speedups, limits))
    out = run(True)()
    vlm_bytes = sum(x.numel() * x.element_size() for x in backbone.vlm.parameters())
    expert_bytes = sum(runner.slot(f"t{i}").memory_bytes()["head"] for i in range(n))
    return {"n_tenants": n, "local_batch": b, "mode": mode, "serial_s": t["serial"], "grouped_s": t["grouped"],
            "speedup": statistics.median(speedups), "limit_speedup": statistics.median(limits),
            "of_limit": statistics.median(of_limits),
            "of_limit_quartiles": statistics.quantiles(of_limits, n=4) if len(of_limits) > 1 else of_limits * 3,
            "of_limit_of_medians": (t["serial"] / t["grouped"]) / (t["dense_split"] / t["dense_one"]),
            "rounds": len(rounds), "dense_one_s": t["dense_one"], "dense_split_s": t["dense_split"],
            "samples_s": samples,
            "largest_group": max(r.group_size for r in out),
            "resident_bytes": {"shared": vlm_bytes + expert_bytes, "separate_models": n * vlm_bytes + expert_bytes,
                               "vlm": vlm_bytes, "experts": expert_bytes},
            "resident_mb": {"shared": round((vlm_bytes + expert_bytes) / 1e6, 1),
                            "separate_models": round((n * vlm_bytes + expert_bytes) / 1e6, 1)}}


def _key(cell: dict) -> str:
    return f"{cell['family']}:{cell['shape']} " + cell_key(cell["mode"], cell["n_tenants"], cell["local_batch"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, a few cells")
    ap.add_argument("--models", default=None,
                    help="family:shape,... (default: all four; --quick: the tiny ones); family:shape=N:b+N:b gives "
                         "that model its own cells in place of --grid (a large model's memory)")
    ap.add_argument("--modes", default=",".join(MODES), help="inference,train (default both)")
    ap.add_argument("--update", action="store_true",
                    help="re-measure this run's cells in the existing result file and keep its others; the file "
                         "lists each run's command and cells under config.runs")
    add_device_arguments(ap)
    add_cell_arguments(ap, "vla_groups", "0.6; --quick 0.2")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: choose from {', '.join(MODES)}")
    device, dtype = parse_device_arguments(ap, args)
    grid, repeats, min_s = cell_plan(args, (QUICK_GRID, FULL_GRID), (3, 5), (0.2, 0.6))
    grids = parse_models(args.models, grid) if args.models else \
        {m: grid for m in MODELS if m[1] == "tiny" or not args.quick}
    models = list(grids)
    env = environment(device, dtype)
    config = {"models": [f"{f}:{s}" for f, s in models], "grids": {f"{f}:{s}": g for (f, s), g in grids.items()},
              "repeats": repeats, "min_seconds": min_s, "warm_each": True,
              "weights": "random (vlamux.model.vla.synthetic)", **env}
    name = "vla_groups_quick.json" if args.quick else "vla_groups.json"
    planned = [f"{f}:{s} " + cell_key(m, n, b) for f, s in models for n, b in grids[(f, s)] for m in modes]
    run = {"argv": list(sys.argv[1:] if argv is None else argv), "cells": planned,
           "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "repeats": repeats, "min_seconds": min_s}
    kept, runs = [], [run]
    if args.update:
        prior = json.loads((Path(args.out) if args.out else RESULTS / name).read_text())
        kept = [c for c in prior["cells"] if _key(c) not in planned]
        runs = prior["config"].get("runs") or [{"argv": None, "cells": [_key(c) for c in prior["cells"]],
                                                "config": prior["config"]}]
        runs = [{**r, "cells": [k for k in r["cells"] if k not in planned]} for r in runs] + [run]
        config["models"] = sorted(set(prior["config"]["models"]) | set(config["models"]))
        config["grids"] = {**prior["config"]["grids"], **config["grids"]}
    config["runs"] = runs
    result = ResultFile(name, args.out, [_key(c) for c in kept] + planned, cells=list(kept), config=config)
    result.done.extend(_key(c) for c in kept)
    cells = result.payload["cells"]
    with tempfile.TemporaryDirectory() as tmp:
        for family, shape in models:
            ckpt, vlm_dir = random_checkpoint(family, shape, Path(tmp) / f"{family}-{shape}", dtype=dtype,
                                              device=device)
            backbone = build_backbone(BackboneSpec(kind="lerobot", path=str(ckpt), vlm=str(vlm_dir)), device, dtype)
            print(f"{family}:{shape}: VLM {backbone.num_parameters() / 1e6:.2f}M params; device={device}, "
                  f"threads={env['threads']}, repeats={repeats}", flush=True)
            for n, b in grids[(family, shape)]:
                for mode in modes:
                    cell = measure_cell(ckpt, vlm_dir, n, b, mode, repeats, min_s, str(device), backbone)
                    cell.update(family=family, shape=shape, preset=f"{family}:{shape}", device=str(device),
                                dtype=env["dtype"])
                    result.cell(f"{family}:{shape} " + cell_key(mode, n, b), cell)
                    print(f"  {mode:9s} N={n:2d} b={b}: speedup {cell['speedup']:.2f}x, limit "
                          f"{cell['limit_speedup']:.2f}x, of limit {cell['of_limit']:.2f}", flush=True)
    print()
    print_table(cells, [("family", "s"), ("shape", "s"), ("mode", "s"), ("n_tenants", "d"), ("local_batch", "d"),
                        ("serial_s", ".4f"), ("grouped_s", ".4f"), ("speedup", ".2f"), ("limit_speedup", ".2f"),
                        ("of_limit", ".2f")])
    path = result.finish()
    worst = min(cells, key=lambda c: c["of_limit"])
    print(f"\nworst cell: {worst['family']}:{worst['shape']} {worst['mode']} {worst['n_tenants']}x"
          f"{worst['local_batch']}: speedup = {worst['of_limit']:.2f} x limit (target >= 0.90)")
    for c in cells:
        if c["n_tenants"] == 8 and c["local_batch"] == 1:
            r = c["resident_bytes"]
            print(f"8 tenants x b=1 {c['family']}:{c['shape']} {c['mode']}: {c['speedup']:.2f}x grouped vs serial "
                  f"(limit {c['limit_speedup']:.2f}x); resident {r['shared'] / 1e6:.1f} MB shared vs "
                  f"{r['separate_models'] / 1e6:.1f} MB as 8 models")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
