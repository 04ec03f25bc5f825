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
    path = ROOT / "scripts" / "experiments" / "metaworld_mt50.py"
    spec = importlib.util.spec_from_file_location("metaworld_mt50", path)
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
        assert row["difficulty"] == "easy" and row["rl_env_steps"] >= 32 and row["rl_env_steps_per_s"] > 0
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
    with pytest.raises(SystemExit):
        mt50.parse_args(["--rl-target-kl", "0"])
    assert mt50.parse_args(["--demos-only", "--tasks", "mt10"]).demos_only


def _evaluation(task, outcomes):
    k, n = outcomes.count("1"), len(outcomes)
    return {"tasks": {task: {"successes": k, "episodes": n, "rate": k / n, "ci95": [0, 1], "outcomes": outcomes}}}


def test_rl_reward_and_the_summary_of_validation_and_sampled_success():
    from vlamux.jobs import load_spec

    mt50 = _script()
    args = mt50.parse_args(["--tasks", "reach-v3"])
    assert (args.rl_reward, args.reward_scale) == ("success", 1.0)
    shaped = mt50.parse_args(["--tasks", "reach-v3", "--rl-reward", "shaped"])
    assert shaped.reward_scale == 0.01
    assert mt50.parse_args(["--rl-reward", "shaped", "--reward-scale", "1"]).reward_scale == 1
    [spec] = mt50.job_specs(args, args.task_list, {"reach-v3": Path("d")})
    assert spec["rl"]["env"]["options"]["reward"] == "success" and "reward" not in spec["eval"]["env"]["options"]
    assert load_spec(spec).rl.target_kl is None  # a job the service reads
    [spec] = mt50.job_specs(mt50.parse_args(["--tasks", "reach-v3", "--rl-target-kl", "0.02"]), ["reach-v3"],
                            {"reach-v3": Path("d")})
    assert load_spec(spec).rl.target_kl == 0.02
    results = {}
    for task, start, rl, curve, kl in (("reach-v3", "1100", "1000", [1, 1, 0, 0, 0, 1, 0, 0], [0.0, 0.2]),
                                       ("push-v3", "0000", "0110", [0, 0, 1, 1], [0.0, 0.0, 0.0, 0.3, 0.1])):
        results[f"mw-{task}"] = {
            "after_sft": _evaluation(task, "1010"), "after": _evaluation(task, "1010"),
            "paired": {"episodes": 4, "gained": 0, "lost": 0, "p_value": 1.0},
            "rl": {"env_steps": 64, "curve": [[i, bool(ok)] for i, ok in enumerate(curve)], "approx_kl": kl,
                   "clip_frac": [k * 2 for k in kl], "passes": [4] * (len(kl) - 1) + [2]},
            "validation": {"kept": "start" if start.count("1") >= rl.count("1") else "rl",
                           "start": _evaluation(task, start), "rl": _evaluation(task, rl),
                           "paired": {"gained": sum(a < b for a, b in zip(start, rl)),
                                      "lost": sum(a > b for a, b in zip(start, rl))}}}
    s = mt50.summary(results)
    assert s["tasks"]["reach-v3"]["rl_sampled"] == {"episodes": 8, "first_quarter": 1.0, "last_quarter": 0.0}
    assert s["tasks"]["push-v3"]["validation"]["rl"]["successes"] == 2
    assert s["tasks"]["reach-v3"]["rl_updates"] == {"approx_kl": [0.0, 0.2], "clip_frac": [0.0, 0.4], "passes": [4, 2]}
    v = s["all"]["validation"]
    assert (v["start"], v["rl"], v["episodes"], v["gained"], v["lost"]) == (2, 3, 8, 2, 1)
    assert s["all"]["rl_sampled"] == {"first_quarter": 0.5, "last_quarter": 0.5}
    # the updates after the critic's warm-up (reach's two are within it): push's last two
    assert s["all"]["rl_updates"] == pytest.approx({"policy_updates": 2, "approx_kl_median": 0.2,
                                                    "clip_frac_median": 0.4, "passes_mean": 3.0})
