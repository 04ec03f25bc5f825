"""vlamux.pretrain on recorded LeRobot datasets (--datasets): several tasks' demonstrations, one
backbone trained on all of them, written where the services load it from."""

import pytest
import torch

from demos import demo_dataset
from vlamux import pretrain
from vlamux.model import BackboneSpec, build_backbone
from vlamux.model.backbones import spec_from_arg


def test_pretraining_on_several_datasets_changes_the_backbone_and_loads(tmp_path):
    data = tmp_path / "data"
    demo_dataset(data / "touch", 2, image_size=16, task="goal/touch-red-cube")
    demo_dataset(data / "lift", 2, image_size=16, task="goal/lift-red-cube")
    out = tmp_path / "bb.safetensors"
    assert pretrain.main(["--datasets", str(data / "*"), "--camera-map",
                          '{"observation.images.agentview": "agentview", "observation.images.wrist": "wrist"}',
                          "--steps", "3", "--batch", "8", "--warmup", "1", "--out", str(out)]) == 0
    trained = build_backbone(BackboneSpec(preset="tiny", weights=str(out)))
    fresh = build_backbone(BackboneSpec(preset="tiny"))
    moved = [n for (n, a), (_, b) in zip(trained.named_parameters(), fresh.named_parameters()) if not torch.equal(a, b)]
    assert moved  # three steps of training moved the weights
    named = build_backbone(spec_from_arg(f"tiny:{out}"))  # as a command line names it
    assert named.backbone_id == trained.backbone_id
    with pytest.raises(ValueError, match="no weights file"):
        spec_from_arg(f"tiny:{tmp_path / 'missing.safetensors'}")


def test_datasets_and_a_camera_map_go_together(tmp_path):
    with pytest.raises(SystemExit):
        pretrain.main(["--datasets", str(tmp_path / "*"), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit):  # nothing matches
        pretrain.main(["--datasets", str(tmp_path / "none*"), "--camera-map", "{}", "--out", str(tmp_path / "x")])
