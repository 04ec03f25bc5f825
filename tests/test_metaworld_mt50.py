"""scripts/experiments/metaworld_mt50.py --quick: two Meta-World tasks end to end through the service
(demonstrations recorded through the environment service, MT10's isolated and multi-tenant runs,
every tenant's SFT, evaluation and RL at once) and a result file with every figure the issue names."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from vlamux.envs.render import configure_gl

configure_gl()
pytest.importorskip("metaworld")

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("metaworld_mt50", ROOT / "scripts" / "experiments" / "metaworld_mt50.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_quick_mode_runs_two_tasks_end_to_end(tmp_path):
    mt50 = _script()
    out = tmp_path / "mt50.json"
    # the pretrained variant: the backbone trained on both tasks' demonstrations first, then shared
    assert mt50.main(["--quick", "--pretrain-steps", "2", "--workdir", str(tmp_path / "runs"), "--data",
                      str(tmp_path / "data"), "--out", str(out), "--device", "cpu", "--dtype", "float32"]) == 0
    doc = json.loads(out.read_text())
    assert doc["task_names"] == list(mt50.QUICK_TASKS) and list(doc["variants"]) == ["pretrained"]
    run = doc["variants"]["pretrained"]
    made = tmp_path / "runs" / "pretrained" / "backbone-2tasks-2steps.safetensors"  # its tasks and steps named
    assert run["backbone"] == f"tiny:{made}" and made.exists()
    for task in mt50.QUICK_TASKS:
        assert doc["demos"][task]["episodes"] == 2
        row = run["tasks"][task]
        assert row["difficulty"] == "easy" and row["rl_env_steps"] >= 32
        for key in ("after_sft", "after_rl"):  # the same seeded episodes before and after RL
            assert row[key]["episodes"] == 2 and 0 <= row[key]["success"] <= 1 and len(row[key]["ci95"]) == 2
        assert row["paired"]["episodes"] == 2
    assert run["all"]["after_sft"]["episodes"] == 4 and "p_value" in run["all"]["paired"]
    for key in ("after_sft", "after_rl"):  # one group here: the groups' mean is its rate
        assert run["all"][key]["group_mean"] == pytest.approx(run["by_difficulty"]["easy"][key]["success"])
    assert set(run["by_difficulty"]) == {"easy"}
    mt10 = run["mt10"]  # (the quick tasks are the subset: its multi-tenant run is the whole run)
    assert run["config"]["sft_steps"] == mt10["config"]["sft_steps"] == 4  # each block with its settings
    assert mt10["tasks"] == list(mt50.QUICK_TASKS) and mt10["isolated"]["wall_s"] > 0 and mt10["multi"]["wall_s"] > 0
    assert mt10["reduction"] == pytest.approx(1 - mt10["multi"]["wall_s"] / mt10["isolated"]["wall_s"])
    assert all(0 < u <= 1 for u in mt10["train_util"])


def test_task_lists_and_bad_arguments_are_named():
    mt50 = _script()
    assert len(mt50.tasks_of("mt50")) == 50 and len(mt50.tasks_of("mt10")) == 10
    assert mt50.tasks_of("metaworld/reach-v3, push-v3") == ["reach-v3", "push-v3"]
    with pytest.raises(SystemExit):
        mt50.parse_args(["--tasks", "reach-v9"])
    with pytest.raises(SystemExit):
        mt50.parse_args(["--sft-steps", "0"])
    assert mt50.parse_args(["--demos-only", "--tasks", "mt10"]).demos_only
