"""The GPU check stays runnable while no GPU is at hand: its dry run executes every step on the CPU
at a tiny size (bfloat16, so every result shows that the choice reached the models), writes every
result file and a summary with the figures the accelerator issue asks for. Its plan fits the device
lease (a machine start and two full runs in 15 minutes); a benchmark cut short keeps the cells it
finished, marked partial; and steps that render are skipped, with the reason, where rendering cannot
work."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _device_check():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(600)  # as its subprocess's own limit: ten benchmark steps, beside another test file
def test_device_check_dry_run(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "scripts/device_check.py", "--dry-run", "--out-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    gl = next(i for i, line in enumerate(lines) if line.startswith("GL: "))
    assert gl < next(i for i, line in enumerate(lines) if line.strip().startswith("tests "))  # before it renders
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["partial"] is False and summary["complete"] is True
    assert summary["gl"]["works"] is True and summary["gl"]["backend"]
    assert all(r["status"] == "ok" for r in summary["steps"].values()), summary["steps"]
    assert summary["steps"]["tests"]["tail"][-1].split("/")[0].isdigit()  # the CUDA tests were collected
    log = (out / "device_check.log").read_text().splitlines()
    assert "tests/test_cuda.py::test_rl_and_evaluation_run_with_the_services_on_cuda" in log  # rendering works here
    assert summary["missing_cells"] == {}
    merged = json.loads((out / "group_batching.json").read_text())
    assert set(merged) == {"base", "vla", "hf"} and all(merged.values())
    assert {c["backbone"] for c in merged["hf"]["cells"]} == {"qwen2_5_vl"}  # the random hf directory the check made
    results = {f"group_batching_{k}": v for k, v in merged.items()}
    tenants = json.loads((out / "tenants.json").read_text())
    assert set(tenants) == {"multi_tenant", "many_tenants"}
    results.update(tenants)
    for name in ("fused_heads", "lora_groups", "inference_serving", "async_rl"):
        results[name] = json.loads((out / f"{name}.json").read_text())
    check = _device_check()
    planned = {s.name: check.planned_cells(s, dry=True) for s in check.steps()}
    for name, result in results.items():
        assert result["partial"] is False and result["planned"] == planned[name] == result["done"], name
        assert summary["steps"][name]["cells"] == {"planned": len(planned[name]), "done": len(planned[name]),
                                                   "missing": [], "partial": False}
        if name == "many_tenants":  # one placement for its cells, in its environment
            placed = result["environment"]["dtype"]
        elif "cells" in result and name != "inference_serving":  # a grid's cells
            placed = {c["dtype"] for c in result["cells"]}.pop()
        else:
            placed = (result.get("placement") or result.get("config"))["dtype"]
        assert placed == "bfloat16", name
    for name in ("group_batching_base", "group_batching_vla", "group_batching_hf"):
        gb = summary[name]["inference"]
        assert gb["grouped_vs_serial"] > 0 and gb["limit"] > 0
    assert summary["fused_heads"]["inference"]["speedup"] > 0
    lora = summary["lora_groups"]["train"]
    assert lora["n_tenants"] == 2 and lora["speedup"] > 0 and lora["limit_speedup"] > 0
    assert results["lora_groups"]["config"]["dtype"] == "bfloat16"  # the dry run's LoRA deltas on a bf16 backbone
    assert summary["lora_groups_worst_of_limit"] > 0
    assert summary["async_rl"]["speedup"] > 0 and "reduction" in summary["multi_tenant"]
    assert set(summary["many_tenants"]) == {"heads:20", "heads:100"}
    assert all(c["within_budget"] and c["requests_per_s"] > 0 for c in summary["many_tenants"].values())
    peaks = {"peak_allocated_bytes", "peak_reserved_bytes", "rollout_reserved_bytes", "model_reserved_bytes",
             "separate"}  # bench/common.py's AllocatorPeaks, read from the allocator (zeros on a CPU)
    for name in ("async_rl", "multi_tenant"):
        assert set(summary["memory_peaks_bytes"][name]) == peaks, name
        assert summary["memory_peaks_bytes"][name]["peak_allocated_bytes"] == 0  # no CUDA allocator here
    assert (out / "device_check.log").stat().st_size > 0
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back from one call
    assert not any(p.is_dir() or p.name.startswith(".") for p in out.iterdir())  # no temporaries, no model folder


def test_the_plan_fits_the_lease_with_room_to_rerun_what_failed():
    """The GPU plan's arithmetic: the step limits (the GL probe's included) add up to no more than the
    budget; the command (budget plus the stated overhead: installs, the check's start, the steps'
    starts) ends within its timeout_s and one call's 10 minutes; a machine start, the run and its
    transfers leave at least RERUN_MIN_S of the 15 minutes for rerunning the steps that failed."""
    check = _device_check()
    p = check.plan()
    assert p["budget_s"] == check.BUDGET_S and p["dry_run"] is False
    assert p["steps_s"] < p["sum_s"] <= p["budget_s"]  # the probe on top of the steps, all within the budget
    assert p["sum_s"] == sum(r["limit_s"] for r in p["steps"]) + p["gl_probe_s"]
    assert p["overhead_s"] and all(v > 0 for v in p["overhead_s"].values())  # stated, part by part
    assert p["command_s"] == p["budget_s"] + sum(p["overhead_s"].values()) <= p["command_max_s"] <= 600
    assert p["machine_start_s"] >= 60  # measured 31-32 s with the transfers (docs/GPU.md)
    assert p["lease_s"] == p["machine_start_s"] + p["command_s"] + p["transfer_s"]
    assert p["rerun_s"] == p["lease_max_s"] - p["lease_s"] >= p["rerun_min_s"] >= 300 and p["lease_max_s"] == 900
    steps = {s.name: s for s in check.steps()}
    default = [s.name for s in check.default_steps()]
    assert [r["name"] for r in p["steps"]] == default and p["extra"] == ["group_batching_vla"]
    assert set(default) | set(p["extra"]) == set(steps)
    for r in p["steps"]:  # every benchmark's grid stated, and its planned cells named
        assert r["cells"] and r["limit_s"] > 0
        assert bool(r["planned"]) == steps[r["name"]].result, r["name"]
    vla = check.plan(chosen=[steps["group_batching_vla"]])["steps"][0]  # a lease of its own (--only)
    assert {"smolvla:smolvla-450m train 8x1", "pi0:pi0-3b inference 4x1"} <= set(vla["planned"])
    assert len(vla["planned"]) == 4
    assert "--scheduler-overhead" not in steps["inference_serving"].gpu  # auto: the CPU-only part skipped on a GPU
    assert {n for n, s in steps.items() if s.renders or s.render_tests} == {"tests", "async_rl", "multi_tenant"}
    assert all("--no-cap" in steps[n].gpu for n in ("group_batching_base", "lora_groups", "group_batching_hf"))


def test_the_steps_cache_their_bytecode_where_the_image_forbids_writing_it(monkeypatch):
    """The GPU image sets PYTHONDONTWRITEBYTECODE; each step's interpreter recompiled torch's sources (6 s
    a step on the H200). The steps' environment drops it and names a bytecode cache they share."""
    check = _device_check()
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    env = check._step_env({"MUJOCO_GL": "egl"})
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["PYTHONPYCACHEPREFIX"] and env["MUJOCO_GL"] == "egl"
    assert check._step_env()["PYTHONPYCACHEPREFIX"] == env["PYTHONPYCACHEPREFIX"]  # one cache for every step


def test_plan_is_printed_without_a_gpu():
    proc = subprocess.run([sys.executable, "scripts/device_check.py", "--plan"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for name in ("gl_probe", "tests", "group_batching_base", "group_batching_hf"):
        assert f"  {name} " in out, name
    assert "  group_batching_vla " not in out and "(each needs a lease of its own, --only): group_batching_vla" in out
    assert "sum of limits" in out and "<= budget 400 s" in out
    assert "N:b 8:1,1:1 x" in out  # the grids, stated
    assert "the lease: machine start 60" in out and "for rerunning the steps that failed" in out
    only = subprocess.run([sys.executable, "scripts/device_check.py", "--plan", "--only", "group_batching_vla"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert only.returncode == 0 and "π0-shaped (3.3B, 4 tenants)" in only.stdout


def test_gpu_md_states_the_plans_limits():
    """docs/GPU.md's table of the check's steps gives each step's limit as the plan does."""
    import re

    check = _device_check()
    text = (ROOT / "docs" / "GPU.md").read_text()
    stated = {m[0]: float(m[1]) for m in re.findall(r"^\| `(\w+)` \| (\d+) s \|", text, re.M)}
    assert stated == {s.name: s.timeout_s for s in check.steps()}
    assert f"within a {check.BUDGET_S:.0f} s budget" in text and f"`timeout_s: {check.COMMAND_MAX_S}`" in text


def test_a_benchmark_killed_mid_way_keeps_its_finished_cells(tmp_path):
    """A group-batching run on the tiny preset, killed once its first cell is in the file: the file
    holds that cell, marked partial; the check's summary lists the planned cells that are missing."""
    out = tmp_path / "group_batching_base.json"
    argv = [sys.executable, "bench/group_batching.py", "--preset", "tiny", "--grid", "1:1,2:1,4:1,8:1", "--repeats",
            "1", "--min-seconds", "0", "--no-cap", "--device", "cpu", "--dtype", "bfloat16", "--out", str(out)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.is_file() and json.loads(out.read_text())["done"]:  # atomic writes: never half a file
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # still running: killed mid-way
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    result = json.loads(out.read_text())
    assert result["partial"] is True
    assert result["planned"] == [f"{m} {n}x1" for n in (1, 2, 4, 8) for m in ("inference", "train")]
    assert 1 <= len(result["done"]) < len(result["planned"])
    assert [f"{c['mode']} {c['n_tenants']}x{c['local_batch']}" for c in result["cells"]] == result["done"]
    assert all(c["speedup"] > 0 and c["dtype"] == "bfloat16" for c in result["cells"])

    check = _device_check()
    runs = {"group_batching_base": {"status": "timed out after 30s"}}
    step = next(s for s in check.steps() if s.name == "group_batching_base")
    summary = check.summarize(tmp_path, runs, True, 30.0, [step])
    missing = [k for k in result["planned"] if k not in result["done"]]
    assert summary["steps"]["group_batching_base"]["cells"] == {"planned": 8, "done": len(result["done"]),
                                                                "missing": missing, "partial": True}
    assert summary["missing_cells"] == {"group_batching_base": missing} and summary["complete"] is False


def test_rendering_steps_are_skipped_with_the_reason_when_rendering_cannot_work(tmp_path):
    """A GL backend MuJoCo cannot load: the probe says why before the first rendering step, the RL
    test is deselected from the CUDA tests, async_rl and multi_tenant are skipped with the reason."""
    env = {**os.environ, "MUJOCO_GL": "no-such-backend"}
    env.pop("VLAMUX_GL_CHOICE", None)
    proc = subprocess.run([sys.executable, "scripts/device_check.py", "--dry-run", "--only",
                           "tests,async_rl,multi_tenant", "--out-dir", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # not ok: two steps did not run
    lines = proc.stdout.splitlines()
    gl = next(i for i, line in enumerate(lines) if line.startswith("GL: rendering cannot work here"))
    assert "no-such-backend" in lines[gl]
    assert gl < next(i for i, line in enumerate(lines) if line.strip().startswith("tests "))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gl"]["works"] is False and "no-such-backend" in summary["gl"]["why"]
    steps = summary["steps"]
    rl_test = "tests/test_cuda.py::test_rl_and_evaluation_run_with_the_services_on_cuda"
    assert steps["tests"]["status"] == "ok" and steps["tests"]["deselected"]["tests"] == [rl_test]
    collected = [line for line in (tmp_path / "device_check.log").read_text().splitlines()
                 if line.startswith("tests/test_cuda.py::")]  # --collect-only -q: one test id a line
    assert collected and rl_test not in collected
    for name in ("async_rl", "multi_tenant"):
        assert steps[name]["status"].startswith("skipped: rendering cannot work here ("), steps[name]
        assert "no-such-backend" in steps[name]["status"]
        assert steps[name]["cells"]["done"] == 0 and steps[name]["cells"]["missing"], steps[name]
    assert set(summary["missing_cells"]) == {"async_rl", "multi_tenant"}


def test_device_check_refuses_to_run_for_real_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, "scripts/device_check.py", "--out-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr


def test_a_gpu_step_is_a_fresh_process_killed_with_its_group_at_its_limit(tmp_path):
    """On a GPU each step is a fresh interpreter (the dry run forks them, tested above): its output and
    exit code come back, and at its limit it is killed with the processes it started."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from step_process import StepProcess
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    done = StepProcess([sys.executable, "-c", "print('out'); import sys; sys.exit(3)"], tmp_path, dict(os.environ),
                       fork=False)
    assert done.finish(30) == (3, "out\n")
    pid_file = tmp_path / "child.pid"
    hangs = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
             f"time.sleep(600)']); open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); "
             "time.sleep(600)")
    step = StepProcess([sys.executable, "-c", hangs], tmp_path, dict(os.environ), fork=False)
    t0 = time.monotonic()
    code, output = step.finish(8)  # a busy neighbour may slow its start: "started" comes well before
    assert code is None and output == "started\n" and time.monotonic() - t0 < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the step's own child outlived it")
