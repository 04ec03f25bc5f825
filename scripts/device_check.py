"""The GPU check: one command that runs the CUDA-marked tests and the GPU benchmarks, and writes
each benchmark's JSON plus one summary.json (default: bench/results/gpu/), inside a wall-time budget
sized for the device lease (15 minutes: the machine's start, this command, and one full rerun).

    python scripts/device_check.py --plan [--dry-run]         # each step's cells and limit, their sum, the lease
    python scripts/device_check.py [--out-dir DIR] [--budget-s 315] [--only a,b]   # on a GPU machine
    python scripts/device_check.py --dry-run [--out-dir DIR]   # every step on the CPU, tiny

Each step is a process (and process group) of its own with its own time limit (a fresh interpreter
on the GPU; the dry run forks it from this process, scripts/step_process.py); the limits add up to less
than the budget (`--plan` prints them, with the grid each step runs on the GPU). A failed or
timed-out step is recorded and the next one runs; steps are skipped, and say so, once the budget is
spent. Every benchmark writes its result file as its cells finish (bench/common.py's ResultFile:
"partial" until it ends), so a step cut short keeps what it measured, and summary.json lists, per
step, the planned cells that are missing. The results and the summary are rewritten after every step,
so a check stopped from outside still leaves what it finished.

Before the first step that renders (the RL test among the CUDA tests, async_rl, multi_tenant) the GL
backend MuJoCo will use is probed in a subprocess (vlamux.envs.render.configure_gl, then a real GL
context) and printed: EGL, or why not. Where rendering cannot work those steps are skipped with that
reason (the RL test deselected) instead of failing one after another; the others inherit the choice.

Out: group_batching.json (the base, vla and hf runs merged), tenants.json (multi_tenant and
many_tenants merged), fused_heads.json, lora_groups.json, inference_serving.json, async_rl.json,
summary.json, device_check.log: eight files, what a device call brings back at most. docs/GPU.md says how to run it on the lent machine (wheels and
GL loaders carried with the tree).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_plan import (BUDGET_S, BUNDLES, COMMAND_MAX_S, DRY_BUDGET_S, DRY_GL_PROBE_S, GL_PROBE_S, MERGED,  # noqa: E402, F401
                         MODES, SKIP_UNDER_S, bundle_key, default_steps, Step, plan, planned_cells, print_plan, steps)
from step_process import StepProcess, preload  # noqa: E402


def _step_env(gl_env: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    # The GPU machine's image sets PYTHONDONTWRITEBYTECODE: every step's fresh interpreter then compiled
    # torch's and transformers' sources again (6 s of each step's first 12, measured on the H200). The
    # bytecode goes to a cache of its own, so the first step writes it and the others read it.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "vlamux-device-check-pycache"))
    return {**env, **(gl_env or {})}


# Run in a fresh interpreter, so the check's own process binds no GL: the choice configure_gl makes
# (and exports, for the steps to inherit), then a real GL context with it (OSMesa chosen on a machine
# without it fails here, not in every rendering step). Leaves by os._exit: a half-made context's
# destructors would print errors at exit.
_GL_PROBE = r"""
import json, os, sys
before = dict(os.environ)
from vlamux.envs.render import configure_gl, gl_choice
configure_gl(probe_timeout_s=float(sys.argv[1]))
out = dict(gl_choice())
out["env"] = {k: v for k, v in os.environ.items()
              if before.get(k) != v and k.startswith(("MUJOCO_", "PYOPENGL_", "VLAMUX_GL"))}
try:
    import mujoco
    ctx = mujoco.GLContext(64, 64)
    ctx.make_current()
    ctx.free()
    out["works"], out["error"] = True, None
except BaseException as e:
    out["works"], out["error"] = False, f"{type(e).__name__}: {e}".replace(chr(10), " ")
print("GL-PROBE " + json.dumps(out), flush=True)
os._exit(0)
"""


def probe_gl(timeout_s: float, log) -> dict:
    """{"backend", "reason", "works", "why" (None if rendering works), "env" (for the steps)}."""
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", _GL_PROBE, str(max(1.0, timeout_s - 4))], cwd=ROOT,
                              env=_step_env(), capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, start_new_session=True)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("GL-PROBE ")), None)
        if line:
            out = json.loads(line.removeprefix("GL-PROBE "))
        else:
            tail = [ln for ln in (done.stderr or "").splitlines() if ln.strip()]
            out = {"backend": None, "reason": None, "env": {}, "works": False,
                   "error": f"the GL probe died (exit {done.returncode}): {tail[-1] if tail else 'no output'}"}
    except subprocess.TimeoutExpired:
        out = {"backend": None, "reason": None, "env": {}, "works": False,
               "error": f"the GL probe timed out after {timeout_s:.0f}s"}
    backend = (out["backend"] or "?").upper()
    if out["works"]:
        out["why"] = None
        line = f"GL: MUJOCO_GL={out['backend']}: {out['reason']}"
        if out["backend"] != "egl":
            line += " (not EGL: rendering runs in software)"
    else:
        chose = f"{out['reason']}; " if out["reason"] else ""
        out["why"] = f"{chose}{backend} cannot render here: {out['error']}" if out["backend"] else out["error"]
        line = f"GL: rendering cannot work here ({out['why']}); the rendering steps are skipped"
    out["wall_s"] = time.monotonic() - t0
    print(line, flush=True)
    log.write(f"{line}\n(GL probe: {out['wall_s']:.1f}s)\n")
    log.flush()
    return out


def run_step(step: Step, dry: bool, work: Path, model: Path, timeout_s: float, log, env: dict,
             extra: list[str] = ()) -> dict:
    argv = [sys.executable, *(a.format(work=work, model=model) for a in (step.dry if dry else step.gpu)), *extra]
    if step.result:
        argv += ["--out", str(work / f"{step.name}.json")]
    log.write(f"\n===== {step.name}: {' '.join(argv[1:])} (limit {timeout_s:.0f}s)\n")
    log.flush()
    t0 = time.monotonic()
    # a session of its own: on a timeout its simulator workers go with it, not into the next step
    proc = StepProcess(argv, ROOT, env, fork=dry)
    try:
        code, output = proc.finish(timeout_s)
    except BaseException:  # the check itself is stopped: the step's process group goes with it
        proc.kill()
        raise
    status = (f"timed out after {timeout_s:.0f}s" if code is None else "ok" if code == 0
              else f"failed (exit {code})")
    wall = time.monotonic() - t0
    log.write(output)
    log.write(f"----- {step.name}: {status} in {wall:.1f}s\n")
    log.flush()
    print(f"  {step.name:20s} {status:28s} {wall:6.1f}s", flush=True)
    out = {"status": status, "wall_s": wall, "limit_s": timeout_s, "tail": output.strip().splitlines()[-3:]}
    if step.name == "tests":
        out["counts"] = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)",
                                                            output)}
    return out


def _load(out_dir: Path, name: str):
    path = out_dir / f"{name}.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:  # not a result file (ResultFile writes atomically; a file of another kind)
        return None


def _cells_of(doc) -> list:
    if isinstance(doc, list):  # a result file of before ResultFile: its cells
        return doc
    return (doc or {}).get("cells") or []


def _cell(cells, mode: str, n: int, b: int) -> dict | None:
    return next((c for c in cells or [] if c["mode"] == mode and c["n_tenants"] == n and c["local_batch"] == b),
                None)


def _pick(doc, keys) -> dict | None:
    out = {k: doc[k] for k in keys if k in doc} if isinstance(doc, dict) else {}
    return out or None


def cell_report(doc, planned: list[str]) -> dict:
    """A step's cells: planned (the result file's list, else the plan's), done, missing, and whether
    the file says partial (None: no result file)."""
    if isinstance(doc, dict) and "planned" in doc:
        planned, done, partial = doc["planned"], doc.get("done", []), doc.get("partial")
    else:
        done, partial = ([] if doc is None else planned), None if doc is None else False
    return {"planned": len(planned), "done": len([k for k in planned if k in done]),
            "missing": [k for k in planned if k not in done], "partial": partial}


def summarize(out_dir: Path, runs: dict, dry: bool, wall_s: float, chosen: list[Step] | None = None,
              gl: dict | None = None, budget_s: float | None = None, running: bool = False) -> dict:
    """The figures the accelerator issue asks for, read from the step results (None where a step
    did not produce them, or not yet), each step's status and missing cells, the GL choice."""
    import torch

    chosen = steps() if chosen is None else chosen
    s: dict = {"dry_run": dry, "partial": running, "date": time.strftime("%Y-%m-%d"), "wall_s": wall_s,
               "budget_s": budget_s, "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not dry else None,
               "gl": gl and {k: gl.get(k) for k in ("backend", "reason", "works", "why", "wall_s")},
               "steps": {}}
    missing = {}
    for step in chosen:
        if step.name not in runs:
            continue
        run = dict(runs[step.name])
        if step.result:
            run["cells"] = cell_report(_load(out_dir, step.name), planned_cells(step, dry))
            if run["cells"]["missing"]:
                missing[step.name] = run["cells"]["missing"]
        s["steps"][step.name] = run
    s["missing_cells"] = missing
    s["complete"] = not running and not missing and all(r["status"] == "ok" for r in runs.values()) \
        and len(runs) == len(chosen)
    n, b = (2, 1) if dry else (8, 1)  # the dry run's grid stops at 2 tenants
    for name in MERGED:
        doc = _load(out_dir, name)
        grouped = {}
        for mode in MODES:
            c = _cell(_cells_of(doc), mode, n, b)
            if c:
                grouped[mode] = {"tenants": n, "local_batch": b, "grouped_vs_serial": c["speedup"],
                                 "limit": c["limit_speedup"], "preset": c.get("preset")}
        s[name] = grouped or None
    fused = _cells_of(_load(out_dir, "fused_heads"))
    s["fused_heads"] = {mode: {"tenants": n, "local_batch": b, "speedup": c["speedup"]}
                        for mode in MODES if (c := _cell(fused, mode, n, b))} or None
    lora = _cells_of(_load(out_dir, "lora_groups"))
    s["lora_groups"] = {mode: {k: c[k] for k in ("n_tenants", "local_batch", "speedup", "limit_speedup", "of_limit",
                                                  "lora_overhead")}
                        for mode in MODES if (c := _cell(lora, mode, n, b))} or None
    s["lora_groups_worst_of_limit"] = min(c["of_limit"] for c in lora) if lora else None
    serving = _load(out_dir, "inference_serving")
    s["inference_serving"] = (serving or {}).get("summary")
    arl = _load(out_dir, "async_rl")
    s["async_rl"] = _pick(arl, ("speedup", "overlap_limit", "sync_steps_per_s", "async_steps_per_s"))
    mt = _load(out_dir, "multi_tenant")
    s["multi_tenant"] = _pick(mt, ("reduction", "train_util_isolated", "train_util_multi", "infer_util_isolated",
                                   "infer_util_multi"))
    s["many_tenants"] = {f"{c['kind']}:{c['tenants']}": _pick(c, ("hit_rate", "requests_per_s", "hot_p99_s",
                                                                 "hot_p99_over_smallest_n", "load_wait_p99_s",
                                                                 "load_wait_p99_over_limit", "within_budget"))
                         for c in _cells_of(_load(out_dir, "many_tenants"))} or None
    memory = {}  # bench/common.py's AllocatorPeaks: the allocator's peaks over the step, reserved bytes by pool
    for name, res in (("async_rl", arl), ("multi_tenant", mt)):
        if isinstance(res, dict) and res.get("memory"):
            memory[name] = _pick(res["memory"], ("peak_allocated_bytes", "peak_reserved_bytes",
                                                 "rollout_reserved_bytes", "model_reserved_bytes", "separate"))
    s["memory_peaks_bytes"] = memory or None
    return s


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _collect(work: Path, out_dir: Path) -> None:
    """The results into `out_dir`: a bundle's steps merged into one file (a device call brings back
    eight files at most), the others as they are."""
    for bundle, names in BUNDLES.items():
        merged = {bundle_key(bundle, name): _load(work, name) for name in names}
        if any(v is not None for v in merged.values()):
            before = _load(out_dir, bundle) or {}  # a rerun of some steps keeps the others' results
            merged = {k: v if v is not None else before.get(k) for k, v in merged.items()}
            _write_atomic(out_dir / f"{bundle}.json", json.dumps(merged, indent=1) + "\n")
    bundled = {name for names in BUNDLES.values() for name in names}
    for f in work.glob("*.json"):
        if f.stem not in bundled:
            _write_atomic(out_dir / f.name, f.read_text())


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="every step on the CPU at a tiny size")
    ap.add_argument("--plan", action="store_true", help="print each step's cells and limit, their sum and the "
                                                        "lease's arithmetic, and run nothing")
    ap.add_argument("--out-dir", default=None, help="default bench/results/gpu (dry run: bench/results/gpu_dry)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"wall-time budget for all steps (default {BUDGET_S:.0f}; dry run {DRY_BUDGET_S:.0f}): "
                         f"the command then fits the lease with a full rerun (--plan)")
    ap.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    args = ap.parse_args(argv)
    chosen = steps() if args.only or args.dry_run else default_steps()  # the dry run checks every step
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {s.name for s in chosen}
        if unknown:
            ap.error(f"--only: unknown steps {sorted(unknown)}; choose from {[s.name for s in chosen]}")
        chosen = [s for s in chosen if s.name in names]
    budget = args.budget_s if args.budget_s is not None else (DRY_BUDGET_S if args.dry_run else BUDGET_S)
    if args.plan:
        print_plan(plan(args.dry_run, budget, chosen))
        return 0
    out_dir = Path(args.out_dir or ROOT / "bench" / "results" / ("gpu_dry" if args.dry_run else "gpu"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("device_check: no CUDA device here; use --dry-run to check the script on a CPU", file=sys.stderr)
            return 2
    t0, runs, gl = time.monotonic(), {}, None
    if args.dry_run:
        preload()  # each step forks from here (scripts/step_process.py)
    print(f"device check{' (dry run)' if args.dry_run else ''}: {len(chosen)} steps, budget {budget:.0f}s, "
          f"results in {out_dir}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="vlamux-device-check-"))
    model = work / "hf-model"

    def publish(running: bool) -> None:  # the results so far and the summary, into out_dir
        _collect(work, out_dir)
        summary = summarize(work, runs, args.dry_run, time.monotonic() - t0, chosen, gl, budget, running)
        _write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")

    # SIGTERM (a timeout from outside) ends the check like Ctrl-C: the step's processes go, the summary stays
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with open(out_dir / "device_check.log", "w") as log:
            for step in chosen:
                left = budget - (time.monotonic() - t0)
                if (step.renders or step.render_tests) and gl is None:  # before the first step that renders
                    gl = probe_gl(min(DRY_GL_PROBE_S if args.dry_run else GL_PROBE_S, max(1.0, left)), log)
                    left = budget - (time.monotonic() - t0)
                if left < SKIP_UNDER_S:
                    runs[step.name] = {"status": "skipped: budget spent"}
                    print(f"  {step.name:20s} skipped: budget spent", flush=True)
                    continue
                extra = []
                if gl is not None and not gl["works"]:
                    if step.renders:
                        runs[step.name] = {"status": f"skipped: rendering cannot work here ({gl['why']})"}
                        print(f"  {step.name:20s} skipped: rendering cannot work here", flush=True)
                        log.write(f"\n===== {step.name}: skipped: rendering cannot work here ({gl['why']})\n")
                        continue
                    for test in step.render_tests:
                        extra += ["--deselect", test]
                limit = step.dry_timeout_s if args.dry_run else step.timeout_s
                env = _step_env(gl and gl["env"])
                runs[step.name] = run_step(step, args.dry_run, work, model, min(limit, left), log, env, extra)
                if extra:
                    runs[step.name]["deselected"] = {"tests": list(step.render_tests),
                                                     "reason": f"rendering cannot work here ({gl['why']})"}
                publish(running=True)
    except KeyboardInterrupt:
        runs["interrupted"] = {"status": "interrupted: the check was stopped"}
        print("device check interrupted: writing what it has", file=sys.stderr)
    finally:
        publish(running=False)
        shutil.rmtree(work, ignore_errors=True)
    failed = [n for n, r in runs.items() if r["status"] != "ok"]
    summary = json.loads((out_dir / "summary.json").read_text())
    gaps = "; ".join(f"{name}: {len(cells)} cells missing" for name, cells in summary["missing_cells"].items())
    print(f"summary: {out_dir / 'summary.json'} ({time.monotonic() - t0:.0f}s)"
          + (f"; not ok: {', '.join(failed)}" if failed else "") + (f"; {gaps}" if gaps else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
