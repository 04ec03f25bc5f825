"""Imported LeRobot VLA policies (vlamux.model.vla) against lerobot itself: for SmolVLA, π0 and π0.5,
the fixture checkpoints' actions for fixed observations and noise, and their training loss for a fixed
batch, noise and flow time, equal lerobot 0.4.4's (tests/fixtures/lerobot_vla: random-weight tiny
checkpoints written by lerobot, with its outputs; see its README for their provenance)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlamux.errors import InvalidInputError
from vlamux.model.vla import LeRobotCheckpoint, VLAPolicy

FIX = Path(__file__).parent / "fixtures" / "lerobot_vla"
VLM_DIR = {"smolvla": FIX / "assets" / "smolvlm2_tiny", "pi0": FIX / "assets" / "paligemma_tokenizer",
           "pi05": FIX / "assets" / "paligemma_tokenizer"}
FAMILIES = ("smolvla", "pi0", "pi05")
TOL = 1e-4


def reference(family: str) -> tuple[dict, dict]:
    return load_file(str(FIX / "references" / f"{family}.safetensors")), \
        json.loads((FIX / "references" / f"{family}.json").read_text())


def frames(ref: dict, batch: str) -> dict:
    """The batch's camera frames as vlamux carries them: uint8 [B, 3, H, W] by camera name."""
    out = {}
    for cam in ("front", "wrist"):
        key = f"{batch}.observation.images.{cam}"
        out[cam] = ref[key + ".uint8_hwc"].permute(0, 3, 1, 2) if key + ".uint8_hwc" in ref else \
            (ref[key] * 255).round().to(torch.uint8)  # lerobot's float frames are k/255 exactly
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, VLAPolicy(FIX / request.param, VLM_DIR[request.param])


def test_actions_equal_lerobots(family):
    name, policy = family
    ref, meta = reference(name)
    for batch in ("batch0", "batch1"):
        actions = policy.act(frames(ref, batch), meta["tasks"][batch], ref[f"{batch}.observation.state"],
                             ref[f"{batch}.noise"])
        assert actions.shape == ref[f"{batch}.action"].shape
        assert (actions - ref[f"{batch}.action"]).abs().max() <= TOL, (name, batch)


def test_training_loss_equals_lerobots(family):
    name, policy = family
    ref, meta = reference(name)
    loss = policy.loss(frames(ref, "train"), meta["tasks"]["train"], ref["train.observation.state"],
                       ref["train.action"], ref["train.noise"], ref["train.time"])
    assert abs(loss.item() - ref["train.loss"].item()) <= TOL * max(1.0, ref["train.loss"].item()), name


def test_the_checkpoint_splits_into_the_vlm_and_the_tenants_module():
    """Every tensor is the VLM's or the module's, as lerobot's own split says (the references' key_split)."""
    for name in FAMILIES:
        ckpt = LeRobotCheckpoint.read(FIX / name)
        _, meta = reference(name)
        vlm, module = ckpt.vlm_tensors(), ckpt.module_tensors()
        assert len(vlm) + len(module) == len(ckpt.tensors)
        tied = sum(ckpt.tensors[target].numel() for alias, target in ckpt.metadata.items()
                   if alias.startswith("model.paligemma_with_expert.paligemma."))  # π0's embedding is its lm_head
        assert sum(t.numel() for t in vlm.values()) + tied == meta["n_params"]["vlm"]
        # the module's count is lerobot's expert plus what it leaves out of both (π0's unused expert lm_head)
        assert sum(t.numel() for t in module.values()) >= meta["n_params"]["expert"]


def test_a_broken_checkpoint_is_refused_naming_the_file(tmp_path):
    import shutil

    bad = tmp_path / "smolvla"
    shutil.copytree(FIX / "smolvla", bad)
    (bad / "config.json").write_text(json.dumps({**json.loads((bad / "config.json").read_text()), "type": "act"}))
    with pytest.raises(InvalidInputError, match="config.json: type 'act'"):
        LeRobotCheckpoint.read(bad)
    (bad / "config.json").unlink()
    with pytest.raises(InvalidInputError, match="config.json: missing"):
        LeRobotCheckpoint.read(bad)
    with pytest.raises(InvalidInputError, match="config.json of the SmolVLM2 model directory"):
        VLAPolicy(FIX / "smolvla", tmp_path)
