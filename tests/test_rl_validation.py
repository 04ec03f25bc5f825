"""An RL job's validation (eval.validation_episodes): its start and end policies on seeds of their own,
RL's kept only where it validated higher, so a job never hands back a policy that validated below the one RL started from."""

import json

import pytest
from safetensors.torch import load_file

from vlamux.jobs import JobSpecError, load_spec
from vlamux.jobs.master import MasterService

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8, "width": 32, "depth": 1}
ENV = {"task": "goal/touch-red-cube", "image_size": 16, "max_steps": 6, "n_action_steps": 2}


def _spec(name: str, **eval_) -> dict:
    return {"name": name, "tenant": name, "kind": "rl", "head": HEAD, "checkpoint_every": 1000,
            "rl": {"env": ENV, "env_steps": 32, "n_envs": 2, "sub_batches": 1, "segment_steps": 4, "mode": "sync",
                   "lr": 1e-2},
            "eval": {"episodes": 2, "n_envs": 2, "before": False, "validation_episodes": 2, **eval_}}


def test_validation_seeds_must_not_overlap_the_evaluations_and_only_rl_jobs_validate():
    with pytest.raises(JobSpecError, match="eval.validation_seed: .*overlap the evaluation's 10000..10019"):
        load_spec(_spec("x", episodes=20, validation_seed=10_010))
    assert load_spec(_spec("x", episodes=20, validation_seed=10_020)).eval.validation_seed == 10_020
    sft = {"name": "s", "tenant": "s", "kind": "sft", "head": HEAD, "sft": {"dataset": "d", "steps": 1},
           "eval": {"episodes": 2, "env": ENV, "validation_episodes": 2}}
    with pytest.raises(JobSpecError, match="eval.validation_episodes: only an rl job validates"):
        load_spec(sft)


class ScriptedValidation(MasterService):
    """The real validation runs (its episodes, seeds and outcomes are kept), but its success is
    replaced by the given figures, start first: RL's outcome on a few episodes cannot be forced, and
    which policy is kept must be shown both ways. The slot at the first validation is saved aside."""

    def __init__(self, runtime, root, successes, seen):
        super().__init__(runtime, root)
        self.successes, self.seen = list(successes), seen

    def _evaluate(self, job, validation=False):
        out = super()._evaluate(job, validation)
        if validation:
            if not self.seen.exists():
                self.services.save_state(job.spec.tenant, self.seen).result(60)
            out["success"] = self.successes.pop(0)
        return out


@pytest.mark.parametrize("start, rl, kept", [(1.0, 0.0, "start"), (0.5, 0.5, "start"), (0.5, 1.0, "rl")])
def test_an_rl_job_keeps_the_policy_that_validated_better(runtime, tmp_path, start, rl, kept):
    seen = tmp_path / "seen_start.safetensors"
    master = ScriptedValidation(runtime, tmp_path / "jobs", [start, rl], seen)
    name = f"val-{kept}"
    job = master.wait(master.submit(_spec(name)), 300)
    assert job.state == "succeeded", job.error
    v = job.result["validation"]
    assert v["kept"] == kept and (v["start"]["success"], v["rl"]["success"]) == (start, rl)
    for which in ("start", "rl"):  # on the validation seeds, not the evaluation's
        [task] = v[which]["tasks"].values()
        assert task["seed"] == 5_000_000 and task["episodes"] == 2
    assert job.result["rl"]["segments_trained"] >= 1  # RL did update the policy
    ckpt = tmp_path / "jobs" / name / "checkpoint.safetensors"
    a, b = load_file(str(ckpt)), load_file(str(seen))
    head = [k for k in a if k.startswith("head.")]
    assert head
    same = all(a[k].shape == b[k].shape and bool((a[k] == b[k]).all()) for k in head)
    # kept the start: the job's checkpoint holds the policy RL started from; kept RL: it differs
    assert same == (kept == "start")
    assert json.loads((tmp_path / "jobs" / name / "state.json").read_text())["phase"] == "rl-done"
    assert not (tmp_path / "jobs" / name / "rl_start.safetensors").exists()  # no file left behind


def test_a_finished_job_resubmitted_keeps_its_choice(runtime, tmp_path):
    """Submitted again once done (as after a restart during its last evaluation), the job neither trains
    nor validates again: the choice it made stands, and its checkpoint is what it hands back."""
    seen = tmp_path / "seen_start.safetensors"
    master = ScriptedValidation(runtime, tmp_path / "jobs", [1.0, 0.0], seen)
    first = master.wait(master.submit(_spec("again")), 300)
    assert first.state == "succeeded", first.error
    assert first.result["validation"]["kept"] == "start"
    again = master.wait(master.submit(_spec("again")), 300)  # no scripted figures left: validating would fail
    assert again.state == "succeeded", again.error
    assert again.result["validation"]["kept"] == "start"
    assert again.result["rl"] == json.loads(json.dumps(first.result["rl"]))  # its record, not a second run
    assert again.result["policy_version"] == first.result["policy_version"]
