"""The GPU check stays runnable while no GPU is at hand: its dry run executes every step on the CPU
at a tiny size (bfloat16, so every result shows that the choice reached the models), writes every
result file and a summary with the figures the accelerator issue asks for."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)  # as its subprocess's own limit: ten benchmark steps, beside another test file
def test_device_check_dry_run(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "scripts/device_check.py", "--dry-run", "--out-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True
    assert all(r["status"] == "ok" for r in summary["steps"].values()), summary["steps"]
    assert summary["steps"]["tests"]["tail"][-1].split("/")[0].isdigit()  # the CUDA tests were collected
    merged = json.loads((out / "group_batching.json").read_text())
    assert set(merged) == {"base", "xl", "hf"} and all(merged.values())
    assert {c["backbone"] for c in merged["hf"]} == {"qwen2_5_vl"}  # the random hf directory the check made
    results = {f"group_batching_{k}": v for k, v in merged.items()}
    for name in ("fused_heads", "lora_groups", "inference_serving", "async_rl", "multi_tenant"):
        results[name] = json.loads((out / f"{name}.json").read_text())
    for name, result in results.items():
        if isinstance(result, list):  # group_batching: its cells
            placed = {c["dtype"] for c in result}.pop()
        else:
            placed = (result.get("placement") or result.get("config"))["dtype"]
        assert placed == "bfloat16", name
    for name in ("group_batching_base", "group_batching_xl", "group_batching_hf"):
        gb = summary[name]["inference"]
        assert gb["grouped_vs_serial"] > 0 and gb["limit"] > 0
    assert summary["fused_heads"]["inference"]["speedup"] > 0
    lora = summary["lora_groups"]["train"]
    assert lora["n_tenants"] == 2 and lora["speedup"] > 0 and lora["limit_speedup"] > 0
    assert summary["lora_groups_worst_of_limit"] > 0
    assert summary["async_rl"]["speedup"] > 0 and "reduction" in summary["multi_tenant"]
    assert set(summary["memory_peaks_bytes"]["multi_tenant"]) >= {"model", "rollout"}
    assert (out / "device_check.log").stat().st_size > 0
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back from one call
    assert not any(p.is_dir() for p in out.iterdir())  # the random model went to a temporary folder


def test_device_check_refuses_to_run_for_real_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, "scripts/device_check.py", "--out-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
