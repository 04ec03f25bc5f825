"""Backbones: the shared, frozen feature extractors behind every tenant.

`BackboneSpec` names a backbone; `build_backbone` makes it. Each `kind` maps
to a factory in `_FACTORIES`:

* ``builtin`` — the download-free family in `builtin.py` (presets tiny, small,
  base), seeded, optionally loaded from a safetensors file.
* ``hf`` — reserved for adapters of real VLMs (Qwen2.5-VL, SmolVLM, ...)
  loaded from a local directory. Such an adapter subclasses `Backbone`, maps
  its processor's output onto `CanonicalBatch` (it may keep its own tokenizer
  and image size through `schema`), and returns the VLM's last hidden states
  (and the last k layers) as a `VLAFeature`. Heads, slots and the group
  runner need no change for it. Not built yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open

from vlamux.model.backbones.base import Backbone
from vlamux.model.backbones.builtin import PRESETS, BuiltinBackbone, BuiltinConfig, builtin_config_dict
from vlamux.utils.io import atomic_save_safetensors
from vlamux.utils.seeding import seeded

__all__ = ["Backbone", "BackboneSpec", "BuiltinBackbone", "BuiltinConfig", "PRESETS", "SHIPPED", "build_backbone",
           "save_backbone", "load_backbone"]

# Weights that ship with the package, by name (`BackboneSpec(weights="tiny-tabletop")`): the tiny preset
# pretrained on the built-in suite's demonstrations by `python -m vlamux.pretrain` (docs/RESULTS.md).
SHIPPED = {"tiny-tabletop": Path(__file__).resolve().parents[2] / "assets" / "tiny-tabletop.safetensors"}


@dataclass(frozen=True)
class BackboneSpec:
    kind: str = "builtin"
    preset: str = "tiny"
    seed: int = 0
    weights: str | None = None  # a safetensors file written by save_backbone

    @property
    def backbone_id(self) -> str:
        if self.weights:
            return f"{self.kind}-{self.preset}@{Path(self.weights).name}"
        return f"{self.kind}-{self.preset}-seed{self.seed}"


def _build_builtin(spec: BackboneSpec) -> Backbone:
    if spec.weights:
        return load_backbone(SHIPPED.get(spec.weights, spec.weights))
    if spec.preset not in PRESETS:
        raise ValueError(f"unknown builtin preset {spec.preset!r}; choose one of {sorted(PRESETS)}")
    with seeded(spec.seed):  # never disturbs the caller's random streams
        return BuiltinBackbone(PRESETS[spec.preset], spec.backbone_id)


def _build_hf(spec: BackboneSpec) -> Backbone:
    raise NotImplementedError(
        "backbone kind 'hf' (Hugging Face VLMs from a local directory) is not available yet; use kind='builtin'"
    )


_FACTORIES = {"builtin": _build_builtin, "hf": _build_hf}


def build_backbone(spec: BackboneSpec | None = None, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> Backbone:
    """Build, freeze and place a backbone."""
    spec = spec or BackboneSpec()
    if spec.kind not in _FACTORIES:
        raise ValueError(f"unknown backbone kind {spec.kind!r}; choose one of {sorted(_FACTORIES)}")
    return _FACTORIES[spec.kind](spec).to(device=device, dtype=dtype).freeze()


def save_backbone(backbone: BuiltinBackbone, path: str | Path) -> None:
    meta = {"format": "vlamux.backbone/1", "kind": "builtin", "backbone_id": backbone.backbone_id,
            "config": json.dumps(builtin_config_dict(backbone.config))}
    tensors = {k: v.detach().cpu().contiguous() for k, v in backbone.state_dict().items()}
    atomic_save_safetensors(tensors, path, meta)


def load_backbone(path: str | Path) -> BuiltinBackbone:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"backbone weights not found: {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != "vlamux.backbone/1":
        raise ValueError(f"{path}: not a vlamux backbone file (metadata format={meta.get('format')!r})")
    backbone = BuiltinBackbone(BuiltinConfig(**json.loads(meta["config"])), meta["backbone_id"])
    backbone.load_state_dict(load_file(str(path)))
    return backbone.freeze()
