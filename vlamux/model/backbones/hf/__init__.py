"""Transformers VLMs from local model directories as vlamux backbones (see backbone.py)."""

from __future__ import annotations

import torch

from vlamux.model.backbones.hf.backbone import HFBackbone, HFBatch
from vlamux.model.backbones.hf.directory import ModelDirError, open_model_dir
from vlamux.model.backbones.hf.families import FAMILIES, family_of

__all__ = ["FAMILIES", "HFBackbone", "HFBatch", "ModelDirError", "load_hf_backbone", "open_model_dir"]


def load_hf_backbone(spec, dtype: torch.dtype = torch.float32) -> HFBackbone:
    """The backbone a `BackboneSpec(kind="hf", path=...)` names, loaded strictly offline. Its id names
    the family, the directory and a hash of its content, so a slot trained on it refuses another."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never a download, whatever a library would try
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    found = open_model_dir(spec.path)
    family = family_of(found.model_type)
    parts = [f"hf-{family.name}@{found.path.name}#{found.identity()}"]
    if spec.layer is not None:
        parts.append(f"layer{spec.layer}")
    if spec.max_layers is not None:
        parts.append(f"first{spec.max_layers}")
    if spec.image_size is not None:
        parts.append(f"{spec.image_size}px")
    return HFBackbone(found, family, "/".join(parts), dtype, spec.layer, spec.max_layers, spec.image_size)
