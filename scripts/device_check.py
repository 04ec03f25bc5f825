"""The GPU check: one command that runs the CUDA-marked tests and the GPU benchmarks, and writes
each benchmark's JSON plus one summary.json (default: bench/results/gpu/), inside a wall-time budget.

    python scripts/device_check.py [--out-dir DIR] [--budget-s 520] [--only a,b]   # on a GPU machine
    python scripts/device_check.py --dry-run [--out-dir DIR]          # every step on the CPU, tiny

Steps, each a subprocess with its own time limit (a failed or timed-out step is recorded and the
next one runs; steps are skipped, and say so, once the budget is spent):
  tests               pytest -m cuda: the tests that need a GPU
  group_batching_base bench/group_batching.py, base preset (86M), 1-16 tenants, up to 256 rows
  fused_heads         bench/fused_heads.py: per-tenant vs fused heads, 1-16 tenants x b in {1, 4}
  lora_groups         bench/lora_groups.py, base preset: N LoRA tenants serial vs one mixed group
  inference_serving   bench/inference_serving.py: 1-16 concurrent sessions
  async_rl            bench/async_rl.py: synchronous vs four-lane RL, one tenant
  multi_tenant        bench/multi_tenant.py: 3 RL + 1 SFT tenants, isolated vs together
  group_batching_xl   group batching on the xl preset (1.0B, 12x base)
  hf_init, group_batching_hf  a random Qwen2.5-VL of the 3B model's shape, and group batching on it
Out: group_batching.json (the three group-batching runs), fused_heads.json, lora_groups.json,
inference_serving.json, async_rl.json, multi_tenant.json, summary.json, device_check.log (eight files,
what a device call brings back at most).
docs/GPU.md says how to run it on the lent machine (wheels and GL loaders carried with the tree).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Step:
    name: str
    gpu: list[str]  # command on a GPU machine (after the interpreter)
    dry: list[str]  # the same step on the CPU at a tiny size
    timeout_s: float
    result: bool = True  # writes <out-dir>/<name>.json (given as --out)


def steps() -> list[Step]:
    """The steps, in order of what the summary needs most. "{work}": the folder the results are written
    to before they are merged; "{model}": where the random hf model directory goes."""
    gpu = ["--device", "cuda", "--dtype", "bfloat16"]
    # bf16 on the CPU: not the CPU default, so each result shows the choice reached the model
    cpu = ["--device", "cpu", "--dtype", "bfloat16"]
    quick = ["--min-seconds", "0.2"]  # a GPU cell is milliseconds: a few repeats beat the noise
    none = ["--min-seconds", "0"]
    # the files that hold cuda-marked tests (collecting every file would need every test extra there)
    pytest = ["-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/test_cuda.py", "tests/test_device.py"]
    gb = "bench/group_batching.py"
    return [
        # the dry run collects the CUDA tests (they import and are selected); they skip without a GPU
        Step("tests", pytest, pytest + ["--collect-only"], 75, result=False),
        Step("group_batching_base", [gb, "--preset", "base", "--grid", "1:1,2:1,4:1,8:1,16:1,8:4,16:16",
                                     "--repeats", "5", *quick, *gpu],
             [gb, "--preset", "tiny", "--grid", "1:1,2:1", "--repeats", "1", *none, *cpu], 45),
        Step("fused_heads", ["bench/fused_heads.py", "--preset", "base", "--repeats", "7", "--vmap", *quick, *gpu],
             ["bench/fused_heads.py", "--preset", "tiny", "--grid", "1:1,2:1", "--repeats", "1", *none, "--vmap", *cpu],
             35),
        Step("lora_groups", ["bench/lora_groups.py", "--backbone", "base", "--repeats", "3", "--min-seconds", "0.1",
                             *gpu],
             ["bench/lora_groups.py", "--backbone", "tiny", "--grid", "1:1,2:1", "--repeats", "1", *none, *cpu], 45),
        Step("inference_serving",
             ["bench/inference_serving.py", "--preset", "base", "--sessions", "1,8,16", "--seconds", "2", *gpu],
             ["bench/inference_serving.py", "--preset", "tiny", "--sessions", "1,2", "--seconds", "0.5", *cpu], 45),
        Step("async_rl",
             ["bench/async_rl.py", "--preset", "base", "--env-steps", "2400", "--n-envs", "8", "--image-size", "64",
              "--threads", "4", "--placement", "shared", *gpu],  # on a GPU the services hold the GPU either way
             ["bench/async_rl.py", "--preset", "tiny", "--env-steps", "32", "--n-envs", "2", "--sub-batches", "1",
              "--image-size", "32", "--placement", "shared", *cpu], 60),
        Step("multi_tenant",
             ["bench/multi_tenant.py", "--sft-steps", "150", "--warm-start-steps", "30", "--rl-env-steps", "1200",
              "--demos", "20", "--demo-cameras", "image", "--threads", "4", "--placement", "shared", *gpu],
             ["bench/multi_tenant.py", "--quick", "--sft-steps", "4", "--warm-start-steps", "2", "--rl-env-steps",
              "32", "--demos", "2", "--demo-cameras", "image", "--placement", "shared", *cpu], 80),
        Step("group_batching_xl", [gb, "--preset", "xl", "--grid", "1:1,8:1,16:4,16:16", "--repeats", "3", *quick, *gpu],
             [gb, "--preset", "tiny", "--grid", "2:1", "--repeats", "1", *none, *cpu], 50),
        # a Qwen2.5-VL of the 3B model's shape, random weights, made on the GPU in bf16 (7 GB on disk)
        Step("hf_init", ["-m", "vlamux.cli", "backbone", "init", "--family", "qwen2_5_vl", "--size", "3b", "--out",
                         "{model}", "--overwrite", "--dtype", "bfloat16", "--device", "cuda"],
             ["-m", "vlamux.cli", "backbone", "init", "--family", "qwen2_5_vl", "--size", "tiny", "--out", "{model}",
              "--overwrite"], 60, result=False),
        Step("group_batching_hf", [gb, "--backbone", "{model}", "--grid", "1:1,8:1,16:4", "--repeats", "3", *quick, *gpu],
             [gb, "--backbone", "{model}", "--grid", "2:1", "--repeats", "1", *none, *cpu], 60),
    ]


# A dry run's steps may take this many times a GPU step's limit: they run on a CPU, which the tests
# share with another worker (`make test` runs two files at a time).
DRY_RUN_SLACK = 2.0
MERGED = ("group_batching_base", "group_batching_xl", "group_batching_hf")  # into group_batching.json


def run_step(step: Step, dry: bool, work: Path, model: Path, timeout_s: float, log) -> dict:
    argv = [sys.executable, *(a.format(work=work, model=model) for a in (step.dry if dry else step.gpu))]
    if step.result:
        argv += ["--out", str(work / f"{step.name}.json")]
    log.write(f"\n===== {step.name}: {' '.join(argv[1:])} (limit {timeout_s:.0f}s)\n")
    log.flush()
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    # a session of its own: on a timeout its simulator workers go with it, not into the next step
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = f"timed out after {timeout_s:.0f}s"
    log.write(output)
    log.write(f"----- {step.name}: {status} in {time.monotonic() - t0:.1f}s\n")
    log.flush()
    print(f"  {step.name:20s} {status:28s} {time.monotonic() - t0:6.1f}s", flush=True)
    out = {"status": status, "wall_s": time.monotonic() - t0, "tail": output.strip().splitlines()[-3:]}
    if step.name == "tests":
        out["counts"] = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)",
                                                            output)}
    return out


def _load(out_dir: Path, name: str):
    path = out_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _cell(cells, mode: str, n: int, b: int) -> dict | None:
    return next((c for c in cells or [] if c["mode"] == mode and c["n_tenants"] == n and c["local_batch"] == b),
                None)


def summarize(out_dir: Path, runs: dict, dry: bool, wall_s: float) -> dict:
    """The figures the accelerator issue asks for, read from the step results (None where a step
    did not produce them)."""
    import torch

    s: dict = {"dry_run": dry, "date": time.strftime("%Y-%m-%d"), "wall_s": wall_s, "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not dry else None,
               "steps": runs}
    n, b = (2, 1) if dry else (8, 1)  # the dry run's grid stops at 2 tenants
    for name in MERGED:
        cells = _load(out_dir, name)
        grouped = {}
        for mode in ("inference", "train"):
            c = _cell(cells, mode, n, b)
            if c:
                grouped[mode] = {"tenants": n, "local_batch": b, "grouped_vs_serial": c["speedup"],
                                 "limit": c["limit_speedup"], "preset": c.get("preset")}
        s[name] = grouped or None
    fused = _load(out_dir, "fused_heads")
    s["fused_heads"] = {mode: {"tenants": n, "local_batch": b, "speedup": c["speedup"]}
                        for mode in ("inference", "train") if (c := _cell(fused and fused["cells"], mode, n, b))} \
        or None
    lora = _load(out_dir, "lora_groups")
    s["lora_groups"] = {mode: {k: c[k] for k in ("n_tenants", "local_batch", "speedup", "limit_speedup", "of_limit",
                                                  "lora_overhead")}
                        for mode in ("inference", "train") if (c := _cell(lora and lora["cells"], mode, n, b))} \
        or None
    if lora:
        s["lora_groups_worst_of_limit"] = min(c["of_limit"] for c in lora["cells"])
    serving = _load(out_dir, "inference_serving")
    s["inference_serving"] = serving and serving["summary"]
    arl = _load(out_dir, "async_rl")
    s["async_rl"] = arl and {"speedup": arl["speedup"], "overlap_limit": arl["overlap_limit"],
                             "sync_steps_per_s": arl["sync_steps_per_s"], "async_steps_per_s": arl["async_steps_per_s"]}
    mt = _load(out_dir, "multi_tenant")
    s["multi_tenant"] = mt and {k: mt[k] for k in ("reduction", "train_util_isolated", "train_util_multi",
                                                    "infer_util_isolated", "infer_util_multi")}
    memory = {}
    for name, res in (("async_rl", arl), ("multi_tenant", mt)):
        if res and res.get("memory"):
            memory[name] = {pool: res["memory"][pool].get("peak_allocated_bytes") for pool in ("model", "rollout")}
            memory[name]["separate_pools"] = res["memory"].get("separate")
    s["memory_peaks_bytes"] = memory or None
    return s


def _collect(work: Path, out_dir: Path) -> None:
    """The results into `out_dir`: the group-batching runs merged into one file (a device call brings
    back eight files at most), the others as they are."""
    merged = {name.removeprefix("group_batching_"): _load(work, name) for name in MERGED}
    if any(v is not None for v in merged.values()):
        (out_dir / "group_batching.json").write_text(json.dumps(merged, indent=1) + "\n")
    for f in work.glob("*.json"):
        if f.stem not in MERGED:
            shutil.copy(f, out_dir / f.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="every step on the CPU at a tiny size")
    ap.add_argument("--out-dir", default=None, help="default bench/results/gpu (dry run: bench/results/gpu_dry)")
    ap.add_argument("--budget-s", type=float, default=520.0,
                    help="wall-time budget for all steps (the lease leaves room for a rerun of a failed step)")
    ap.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out_dir or ROOT / "bench" / "results" / ("gpu_dry" if args.dry_run else "gpu"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("device_check: no CUDA device here; use --dry-run to check the script on a CPU", file=sys.stderr)
            return 2
    chosen = steps()
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {s.name for s in chosen}
        if unknown:
            ap.error(f"--only: unknown steps {sorted(unknown)}; choose from {[s.name for s in chosen]}")
        chosen = [s for s in chosen if s.name in names]
    t0, runs = time.monotonic(), {}
    print(f"device check{' (dry run)' if args.dry_run else ''}: {len(chosen)} steps, budget {args.budget_s:.0f}s, "
          f"results in {out_dir}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="vlamux-device-check-"))
    model = work / "hf-model"
    with open(out_dir / "device_check.log", "w") as log:
        for step in chosen:
            left = args.budget_s - (time.monotonic() - t0)
            if left < 15:
                runs[step.name] = {"status": "skipped: budget spent"}
                print(f"  {step.name:20s} skipped: budget spent", flush=True)
                continue
            limit = step.timeout_s * (DRY_RUN_SLACK if args.dry_run else 1.0)
            runs[step.name] = run_step(step, args.dry_run, work, model, min(limit, left), log)
    summary = summarize(work, runs, args.dry_run, time.monotonic() - t0)
    _collect(work, out_dir)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    failed = [n for n, r in runs.items() if r["status"] != "ok"]
    print(f"summary: {out_dir / 'summary.json'} ({time.monotonic() - t0:.0f}s)"
          + (f"; not ok: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
