"""The GPU check's plan: its steps, the grid each runs on the GPU (and, tiny, in the dry run), their
time limits, and the arithmetic that fits them into the device lease. `scripts/device_check.py`
runs it; `python scripts/device_check.py --plan` prints it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))
from cells import cell_key, parse_grid, parse_models  # noqa: E402 - the benchmarks' own reading of their cells

# The lease (docs/GPU.md): 15 minutes of device time for the machine's start, the transfers, this
# command and one full rerun of it. The command (scripts/device_prepare.sh prints it) is the check
# plus what runs before and around its budget, assumed here:
BUDGET_S = 400.0  # the steps, the GL probe included
COMMAND_OVERHEAD_S = {
    "unpack the GL loaders, install the carried wheels": 20,
    "the check's own start (Python, torch, CUDA) and its last summary": 10,
    "starting each step's process, collecting its results (10 steps)": 10,
}
COMMAND_MAX_S = 440  # the device call's timeout_s
# Measured on 2026-12-04, the first two calls on an H200: a fresh machine's start and the transfers
# took 31-32 s a call (held_s less the command's wall_s); stated here with room
MACHINE_START_S = 60
TRANSFER_S = 10  # per call: the tree with .whl and .gl up (about 36 MB), at most 8 files back
LEASE_S = 900
# what the lease keeps, after the start and a full run, for rerunning the steps that failed (`--only`)
RERUN_MIN_S = 300
GL_PROBE_S = 15.0  # the GL probe's subprocess: a fresh interpreter, the EGL probe, one GL context

# The dry run (the test suite runs it on a shared 2-core CPU, beside another test file): its own,
# looser limits, and a budget that ends it inside the test's 600 s.
DRY_BUDGET_S = 560.0
DRY_GL_PROBE_S = 20.0
SKIP_UNDER_S = 15.0  # a step is not started with less of the budget left

GRID_BENCHES = ("bench/group_batching.py", "bench/fused_heads.py", "bench/lora_groups.py")
VLA_BENCH = "bench/vla_groups.py"
MODES = ("inference", "train")


@dataclass
class Step:
    name: str
    gpu: list[str]  # command on a GPU machine (after the interpreter)
    dry: list[str]  # the same step on the CPU at a tiny size
    timeout_s: float  # on the GPU
    dry_timeout_s: float
    what: str  # what the step measures on the GPU, beside the grid its arguments give
    result: bool = True  # writes <out-dir>/<name>.json (given as --out)
    renders: bool = False  # simulates with MuJoCo: skipped, with the GL probe's reason, when rendering cannot work
    render_tests: tuple[str, ...] = ()  # pytest ids that render: deselected, with the reason, then
    extra: bool = False  # not in the default run (it does not fit its lease): run it by name, `--only`


def steps() -> list[Step]:
    """The steps, in order of what the summary needs most; each benchmark's grid in the order its cells
    run, the summary's cell (8 tenants x b=1) first, so a step cut short keeps the figure that matters.
    "{work}": the folder the results are written to before they are merged; "{model}": where the random
    hf model directory goes.

    The GPU limits are each step's wall time on the H200 on 2026-12-04 (bench/results/gpu/summary.json)
    with 10-25% of room, the bytecode cached by the first step (`_step_env`): a step's interpreter
    starts in about 5 s, a base cell and mode takes 2-4 s, the 3B model's 5-10 s. Where a step had not
    finished there, its limit is a guess and says so."""
    gpu = ["--device", "cuda", "--dtype", "bfloat16"]
    # bf16 on the CPU: not the CPU default, so each result shows the choice reached the model
    cpu = ["--device", "cpu", "--dtype", "bfloat16"]
    quick = ["--min-seconds", "0.1"]  # a GPU cell is milliseconds: 0.1 s is tens of calls
    none = ["--min-seconds", "0"]
    # the files that hold cuda-marked tests (collecting every file would need every test extra there)
    pytest = ["-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "tests/test_cuda.py", "tests/test_device.py"]
    gb = "bench/group_batching.py"
    return [
        # the dry run collects the CUDA tests (they import and are selected); they skip without a GPU
        # on the GPU -v: a line a test as it ends, so a step cut short still says which passed; the dry run
        # collects them (-q: one test id a line)
        Step("tests", pytest + ["-v"], pytest + ["-q", "--collect-only"], 45, 30,
             "pytest -m cuda: tests/test_cuda.py, tests/test_device.py (tiny backbone; the RL test renders)",
             result=False, render_tests=("tests/test_cuda.py::test_rl_and_evaluation_run_with_the_services_on_cuda",)),
        Step("group_batching_base", [gb, "--preset", "base", "--grid", "8:1,1:1,4:1,16:1", "--repeats", "3",
                                     "--no-cap", *quick, *gpu],
             [gb, "--preset", "tiny", "--grid", "2:1,1:1", "--repeats", "1", *none, *cpu], 45, 50,
             "base preset (86M), two 128 px cameras; no b=4 cell at 16 tenants (the lease's time went to pi0-3b)"),
        Step("fused_heads", ["bench/fused_heads.py", "--preset", "base", "--grid", "8:1,1:1,4:1,16:1,16:4",
                             "--repeats", "3", *quick, "--vmap", *gpu],
             ["bench/fused_heads.py", "--preset", "tiny", "--grid", "2:1,1:1", "--repeats", "1", *none, "--vmap",
              *cpu], 45, 40,  # a guess: 8 of its 10 cells took 30 s
             "gaussian heads on base features: per-tenant loop vs one fused call (and vmap)"),
        Step("lora_groups", ["bench/lora_groups.py", "--backbone", "base", "--grid", "8:1,1:1,4:1", "--repeats", "3",
                             "--no-cap", *quick, *gpu],
             ["bench/lora_groups.py", "--backbone", "tiny", "--grid", "2:1", "--repeats", "1", *none, *cpu], 32, 60,
             "base preset, rank-8 LoRA per tenant: serial vs one mixed group (the limit: a backward through base)"),
        Step("inference_serving",
             ["bench/inference_serving.py", "--preset", "base", "--sessions", "16,8,1", "--seconds", "1",
              "--limit-seconds", "0.2", *gpu],  # the no-op scheduler's cost is a CPU figure: skipped on a GPU
             ["bench/inference_serving.py", "--preset", "tiny", "--sessions", "2,1", "--seconds", "0.5",
              "--limit-seconds", "0.2", *cpu], 32, 60,
             "base preset, closed-loop sessions: grouped service vs B=1, and the plain model's limit"),
        # issue 28's cell: ten thousand tenants on one replica, 200 slots resident on the GPU, 1,000 parked
        # in pinned host memory, the rest stored; the moves on the replica's page stream beside its groups
        # (a GPU serves the 72 clients' requests in milliseconds: they think 0.25 s, not a CPU's 5 s)
        Step("many_tenants", ["bench/many_tenants.py", "--tenants", "100", "--kinds", "heads", "--seconds", "4",
                              "--rounds", "1", "--think-s", "0.25", *gpu],
             ["bench/many_tenants.py", "--tenants", "20,100", "--kinds", "heads", "--seconds", "1", "--rounds", "1",
              "--clients", "8", "--hot-clients", "2", "--resident-slots", "10", "--parked-slots", "20",
              "--think-s", "0", "--backbone", "tiny", "--image-size", "32", *cpu], 17, 60,
             "small backbone, Gaussian heads of 100 and 10,000 registered tenants, 64 Zipf clients: hot and "
             "cold latency, load waits against a plain forward and load"),
        Step("async_rl",
             ["bench/async_rl.py", "--preset", "base", "--env-steps", "1600", "--n-envs", "8", "--image-size", "64",
              "--threads", "4", "--placement", "shared", *gpu],  # on a GPU the services hold the GPU either way
             ["bench/async_rl.py", "--preset", "tiny", "--env-steps", "32", "--n-envs", "2", "--sub-batches", "1",
              "--image-size", "32", "--placement", "shared", *cpu], 25, 50,
             "base preset, one tenant, 2 x 8 envs at 64 px: synchronous vs four-lane RL", renders=True),
        Step("multi_tenant",
             ["bench/multi_tenant.py", "--sft-steps", "80", "--warm-start-steps", "20", "--rl-env-steps", "600",
              "--demos", "10", "--demo-cameras", "image", "--threads", "4", "--placement", "shared", *gpu],
             ["bench/multi_tenant.py", "--quick", "--tenants", "2", "--sft-steps", "4", "--warm-start-steps", "2",
              "--rl-env-steps", "32", "--demos", "2", "--demo-cameras", "image", "--placement", "shared", *cpu], 50, 260,
             "tiny backbone, 3 RL + 1 SFT tenants: one after another (fresh services each) vs together",
             renders=True),
        # imported VLA tenants at SmolVLA's and π0's published sizes (random weights drawn on the GPU, written
        # in bf16: 0.9 and 6.6 GB), one cell each: writing, reading and hashing π0's 6.6 GB is most of the step;
        # π0 at 4 tenants (each 0.3B expert in fp32 with its AdamW state is 5 GB, and the benchmark's plain
        # contender holds a second copy: 8 would be over 100 GB of the H200's 139)
        Step("group_batching_vla", ["bench/vla_groups.py", "--models", "smolvla:smolvla-450m,pi0:pi0-3b=4:1", "--grid",
                                    "8:1", "--repeats", "3", *quick, *gpu],
             ["bench/vla_groups.py", "--models", "smolvla:tiny", "--grid", "2:1", "--repeats", "1", *none, *cpu],
             150, 40, "SmolVLA- (450M, 8 tenants) and π0-shaped (3.3B, 4 tenants) random policies: the tenants' "
             "prefixes in one VLM forward, experts fused", extra=True),
        # a Qwen2.5-VL of the 3B model's shape, random weights, made on the GPU in bf16 (7 GB on disk)
        Step("hf_init", ["-m", "vlamux.cli", "backbone", "init", "--family", "qwen2_5_vl", "--size", "3b", "--out",
                         "{model}", "--overwrite", "--dtype", "bfloat16", "--device", "cuda"],
             ["-m", "vlamux.cli", "backbone", "init", "--family", "qwen2_5_vl", "--size", "tiny", "--out", "{model}",
              "--overwrite"], 30, 30, "a random Qwen2.5-VL of the 3B model's shape, made on the GPU (7 GB written)",
             result=False),
        Step("group_batching_hf", [gb, "--backbone", "{model}", "--grid", "8:1,1:1", "--repeats", "3", "--no-cap",
                                   *quick, *gpu],
             [gb, "--backbone", "{model}", "--grid", "2:1", "--repeats", "1", *none, *cpu], 55, 50,
             "the 3B-shaped Qwen2.5-VL (loaded from disk, its processor on the host per request)"),
    ]


def default_steps() -> list[Step]:
    """The steps a run without `--only` takes: all but the extras."""
    return [s for s in steps() if not s.extra]


# Steps whose results share one file (a device call brings back eight files at most): the file's name,
# its steps; each step's result under its name less the file's name as a prefix ("base", "many_tenants")
BUNDLES = {"group_batching": ("group_batching_base", "group_batching_vla", "group_batching_hf"),
           "tenants": ("multi_tenant", "many_tenants")}
MERGED = BUNDLES["group_batching"]


def bundle_key(bundle: str, step: str) -> str:
    return step.removeprefix(bundle + "_")


def _arg(argv: list[str], flag: str, default: str | None = None) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else default


def planned_cells(step: Step, dry: bool) -> list[str]:
    """The keys of the cells a step's result file will list as planned (bench/common.py's ResultFile)."""
    argv = step.dry if dry else step.gpu
    script = argv[0]
    placements = ["shared", "split"] if _arg(argv, "--placement", "both") == "both" else [_arg(argv, "--placement")]
    if script in GRID_BENCHES or script == VLA_BENCH:
        grid = parse_grid(_arg(argv, "--grid"))
        if script != VLA_BENCH:
            return [cell_key(mode, n, b) for n, b in grid for mode in MODES]
        return [f"{family}:{shape} " + cell_key(mode, n, b)
                for (family, shape), cells in parse_models(_arg(argv, "--models"), grid).items()
                for n, b in cells for mode in MODES]
    if script == "bench/inference_serving.py":
        return [f"K={k} {part}" for k in _arg(argv, "--sessions").split(",")
                for part in ("limit", "baseline", "grouped")]
    if script == "bench/async_rl.py":
        return [f"{p} {mode}" for p in placements for mode in ("sync", "async")]
    if script == "bench/multi_tenant.py":
        return [f"{p} {mode}" for mode in ("isolated", "multi") for p in placements]
    if script == "bench/many_tenants.py":
        return [f"{k}:{n}" for k in _arg(argv, "--kinds").split(",") for n in _arg(argv, "--tenants").split(",")]
    return []


def describe(step: Step, dry: bool) -> str:
    """A step's cells, stated: the grid its arguments give, and what it measures."""
    argv = step.dry if dry else step.gpu
    cells = planned_cells(step, dry)
    script = argv[0]
    if script in GRID_BENCHES or script == VLA_BENCH:
        grid = f"N:b {_arg(argv, '--grid')} x {', '.join(MODES)} = {len(cells)} cells, {_arg(argv, '--repeats')} " \
               f"repeats, >= {_arg(argv, '--min-seconds')} s a contender"
    elif script == "bench/inference_serving.py":
        grid = f"K {_arg(argv, '--sessions')} sessions x limit, baseline, grouped = {len(cells)} cells, " \
               f"{_arg(argv, '--seconds')} s a run"
    elif script == "bench/async_rl.py":
        grid = f"{_arg(argv, '--env-steps')} env steps x sync, async = {len(cells)} cells"
    elif script == "bench/multi_tenant.py":
        grid = f"SFT {_arg(argv, '--sft-steps')} steps, RL {_arg(argv, '--rl-env-steps')} env steps; isolated, " \
               f"multi = {len(cells)} cells"
    elif script == "bench/many_tenants.py":
        grid = f"N {_arg(argv, '--tenants')} x {_arg(argv, '--kinds')} = {len(cells)} cells, {_arg(argv, '--seconds')} s " \
               f"a window"
    else:
        grid = ""
    if dry:
        return grid or " ".join(argv)
    return f"{grid}; {step.what}" if grid else step.what


def plan(dry: bool = False, budget_s: float | None = None, chosen: list[Step] | None = None) -> dict:
    """Each step's limit and cells, their sum, and the lease's arithmetic (the GPU run's)."""
    chosen = (steps() if dry else default_steps()) if chosen is None else chosen
    budget = budget_s if budget_s is not None else (DRY_BUDGET_S if dry else BUDGET_S)
    probe = DRY_GL_PROBE_S if dry else GL_PROBE_S
    rows = [{"name": s.name, "limit_s": s.dry_timeout_s if dry else s.timeout_s, "cells": describe(s, dry),
             "planned": planned_cells(s, dry), "renders": s.renders or bool(s.render_tests)} for s in chosen]
    steps_s = sum(r["limit_s"] for r in rows)
    renders = any(r["renders"] for r in rows)
    total = steps_s + (probe if renders else 0)
    overhead = sum(COMMAND_OVERHEAD_S.values())
    command = budget + overhead
    return {"dry_run": dry, "budget_s": budget, "gl_probe_s": probe if renders else 0, "steps": rows,
            "steps_s": steps_s, "sum_s": total, "overhead_s": dict(COMMAND_OVERHEAD_S), "command_s": command,
            "command_max_s": COMMAND_MAX_S, "machine_start_s": MACHINE_START_S, "transfer_s": TRANSFER_S,
            "lease_s": MACHINE_START_S + command + TRANSFER_S, "lease_max_s": LEASE_S,
            "rerun_s": LEASE_S - (MACHINE_START_S + command + TRANSFER_S), "rerun_min_s": RERUN_MIN_S,
            "extra": [s.name for s in steps() if s.extra and s not in chosen]}


def print_plan(p: dict) -> None:
    kind = "dry run (the CPU, tiny sizes)" if p["dry_run"] else "on the GPU"
    print(f"device check plan, {kind}: {len(p['steps'])} steps, budget {p['budget_s']:.0f} s")
    print(f"  {'step':20s} {'limit':>6s}  cells")
    if p["gl_probe_s"]:
        print(f"  {'gl_probe':20s} {p['gl_probe_s']:5.0f}s  MuJoCo's GL backend for the rendering steps (EGL, or "
              f"why not), in a subprocess, before the first of them")
    for r in p["steps"]:
        print(f"  {r['name']:20s} {r['limit_s']:5.0f}s  {r['cells']}{'  [renders]' if r['renders'] else ''}")
    ok = p["sum_s"] <= p["budget_s"]
    print(f"  {'sum of limits':20s} {p['sum_s']:5.0f}s  {'<=' if ok else '>'} budget {p['budget_s']:.0f} s"
          + ("" if ok or not p["dry_run"] else " (the dry run's limits are ceilings for a loaded 2-core CPU; "
                                                 "the budget keeps it inside the test's 600 s)"))
    if p["dry_run"]:
        return
    parts = " + ".join(f"{v:.0f} ({k})" for k, v in p["overhead_s"].items())
    print(f"the command: budget {p['budget_s']:.0f} + overhead {parts} = {p['command_s']:.0f} s "
          f"{'<=' if p['command_s'] <= p['command_max_s'] else '>'} {p['command_max_s']:.0f} s (its timeout_s)")
    print(f"the lease: machine start {p['machine_start_s']:.0f} + {p['command_s']:.0f} (a run) + "
          f"{p['transfer_s']:.0f} (transfers) = {p['lease_s']:.0f} s of {p['lease_max_s']:.0f} s, leaving "
          f"{p['rerun_s']:.0f} s {'>=' if p['rerun_s'] >= p['rerun_min_s'] else '<'} {p['rerun_min_s']:.0f} s "
          f"for rerunning the steps that failed (--only)")
    if p["extra"]:
        print(f"not in the default run (each needs a lease of its own, --only): {', '.join(p['extra'])}")
