"""Backbones: the shared, frozen feature extractors behind every tenant.

`BackboneSpec` names a backbone; `build_backbone` makes it. Each `kind` maps
to a factory in `_FACTORIES`:

* ``builtin`` — the download-free family in `builtin.py` (presets tiny, small,
  base), seeded, optionally loaded from a safetensors file.
* ``hf`` — a transformers VLM from a local model directory laid out as the
  hub ships it (`hf/`): Qwen2-VL / Qwen2.5-VL so far. Its family's processor
  prepares each request (`Backbone.prepare`), a group's requests are padded
  into one forward of the transformers model, and its hidden states come back
  as a `VLAFeature`. Heads, slots and the group runner need no change for it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open

from vlamux.model.backbones.base import Backbone
from vlamux.model.backbones.builtin import PRESETS, BuiltinBackbone, BuiltinConfig, builtin_config_dict
from vlamux.utils.io import atomic_save_safetensors, tensors_sha256
from vlamux.utils.seeding import seeded, seeded_on

__all__ = ["Backbone", "BackboneSpec", "BuiltinBackbone", "BuiltinConfig", "PRESETS", "SHIPPED", "build_backbone",
           "save_backbone", "load_backbone", "spec_from_arg"]

# Weights that ship with the package, by name (`BackboneSpec(weights="tiny-tabletop")`): the tiny preset
# pretrained on the built-in suite's demonstrations by `python -m vlamux.pretrain` (docs/RESULTS.md).
SHIPPED = {"tiny-tabletop": Path(__file__).resolve().parents[2] / "assets" / "tiny-tabletop.safetensors"}


@dataclass(frozen=True)
class BackboneSpec:
    kind: str = "builtin"
    preset: str = "tiny"
    seed: int = 0
    weights: str | None = None  # builtin: a safetensors file written by save_backbone
    path: str | None = None  # hf: the model directory
    layer: int | None = None  # hf: features from this decoder layer's output (None: the last, normed)
    max_layers: int | None = None  # hf: keep the first N decoder layers only (SmolVLA-style truncation)
    image_size: int | None = None  # hf: cameras resized to this square first (bounds their tokens)
    vlm: str | None = None  # lerobot: the VLM / tokenizer directory the checkpoint (`path`) names by hub id

    @property
    def backbone_id(self) -> str:
        """builtin only: an hf backbone's id includes its directory's content hash (`Backbone.backbone_id`)."""
        if self.kind in ("hf", "lerobot"):
            raise ValueError(f"a {self.kind} backbone's id is known once its files are read: build it and ask it")
        if self.weights:
            return f"{self.kind}-{self.preset}@{Path(self.weights).name}"
        return f"{self.kind}-{self.preset}-seed{self.seed}"


# A built-in preset of this many block parameters or more, bound for a GPU, is built there (4 GB of
# fp32 weights for the xl preset: not made on the host, moved, and hashed through the host)
ON_DEVICE_PARAMS = 300_000_000


def _build_builtin(spec: BackboneSpec, device: torch.device) -> tuple[Backbone, str]:
    """The backbone and its content digest: the sha256 of its weights as built (fp32, on the CPU: the
    same on every machine), or, for a random preset built on its GPU, of its recipe (preset, seed, and
    what drew it: the GPU model and its multiprocessor count, which shape CUDA's random streams, and
    torch), which names those weights without a host copy of them."""
    if spec.weights:
        b = load_backbone(SHIPPED.get(spec.weights, spec.weights))
        return b, _weights_sha256(b)
    if spec.preset not in PRESETS:
        raise ValueError(f"unknown builtin preset {spec.preset!r}; choose one of {sorted(PRESETS)}")
    config = PRESETS[spec.preset]
    if device.type == "cuda" and 12 * config.depth * config.dim ** 2 >= ON_DEVICE_PARAMS:
        with seeded_on(spec.seed, device):  # never disturbs the caller's random streams either
            b = BuiltinBackbone(config, spec.backbone_id)
        gpu = torch.cuda.get_device_properties(device)  # CUDA's random streams depend on the grid it launches
        recipe = json.dumps({"kind": "builtin", "config": builtin_config_dict(config), "seed": spec.seed,
                             "drawn_on": {"gpu": gpu.name, "multiprocessors": gpu.multi_processor_count},
                             "torch": torch.__version__}, sort_keys=True)
        return b, hashlib.sha256(recipe.encode()).hexdigest()
    with seeded(spec.seed):  # never disturbs the caller's random streams
        b = BuiltinBackbone(config, spec.backbone_id)
    return b, _weights_sha256(b)


def _weights_sha256(b: Backbone) -> str:
    return tensors_sha256({k: v.detach().cpu() for k, v in b.state_dict().items()})


def _build_hf(spec: BackboneSpec, dtype: torch.dtype) -> Backbone:
    from vlamux.model.backbones.hf import load_hf_backbone

    if not spec.path:
        raise ValueError("backbone spec: kind 'hf' needs path (a local model directory)")
    return load_hf_backbone(spec, dtype)


def spec_from_arg(value: str, vlm: str | None = None, **hf_options) -> BackboneSpec:
    """A backbone named on a command line: a built-in preset ("tiny"), shipped weights
    ("tiny-tabletop"), a preset with a weights file ("tiny:runs/backbone.safetensors", as
    `vlamux.pretrain` writes), a model directory (an hf VLM), or "lerobot:CKPT_DIR" (a LeRobot checkpoint's VLM,
    with `vlm` the directory of the VLM/tokenizer files it names by hub id)."""
    if value.startswith("lerobot:"):
        from vlamux.model.vla.checkpoint import LeRobotCheckpoint

        path = Path(value.removeprefix("lerobot:")).expanduser()
        LeRobotCheckpoint.read_config(path)  # a clear error now, not once the services start
        if vlm is None or not Path(vlm).expanduser().is_dir():
            from vlamux.model.vla.checkpoint import named_vlm

            raise ValueError(f"backbone {value!r}: give --vlm DIR, the local directory of {named_vlm(path)!r} (the "
                             f"hub repository the checkpoint names for its VLM config and tokenizer)")
        return BackboneSpec(kind="lerobot", path=str(path), vlm=str(Path(vlm).expanduser()))
    if value in PRESETS:
        return BackboneSpec(preset=value)
    preset, _, weights = value.partition(":")
    if preset in PRESETS and weights:  # "tiny:runs/backbone.safetensors": a preset with weights of its own
        if not Path(weights).expanduser().is_file():
            raise ValueError(f"backbone {value!r}: no weights file {weights}")
        return BackboneSpec(preset=preset, weights=str(Path(weights).expanduser()))
    if value in SHIPPED:
        return BackboneSpec(preset=value.split("-")[0], weights=value)
    if Path(value).expanduser().is_dir():
        return BackboneSpec(kind="hf", path=str(Path(value).expanduser()), **hf_options)
    raise ValueError(f"backbone {value!r}: not a preset ({sorted(PRESETS)}), shipped weights ({sorted(SHIPPED)}) "
                     f"or a model directory")


def named_backbones(items, vlm: str | None = None) -> dict[str, BackboneSpec]:
    """`--add-backbone NAME=PRESET_OR_DIR` values by name (ValueError naming a malformed one)."""
    out = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        if not sep or not name or not value:
            raise ValueError(f"extra backbone {item!r}: expected NAME=PRESET_OR_DIR")
        out[name] = spec_from_arg(value, vlm=vlm)
    return out


def build_backbone(spec: BackboneSpec | None = None, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> Backbone:
    """Build, freeze and place a backbone."""
    spec = spec or BackboneSpec()
    if spec.kind == "builtin":
        b, digest = _build_builtin(spec, torch.device(device))  # digested as built: fp32, before any cast
        b = b.to(device=device, dtype=dtype).freeze()
    elif spec.kind == "hf":  # loaded in its dtype (a bf16 checkpoint never passes through fp32)
        b = _build_hf(spec, dtype).to(device=device).freeze()
        digest = b.model_dir.identity(full=True)
    elif spec.kind == "lerobot":  # a LeRobot checkpoint's VLM: digested as the checkpoint holds it
        from vlamux.model.backbones.lerobot import LeRobotBackbone

        if not spec.path:
            raise ValueError("backbone spec: kind 'lerobot' needs path (a LeRobot checkpoint directory) and vlm")
        b = LeRobotBackbone(spec.path, spec.vlm).to(device=device, dtype=dtype).freeze()
        digest = b.content_sha256
    else:
        raise ValueError(f"unknown backbone kind {spec.kind!r}; choose one of ['builtin', 'hf', 'lerobot']")
    b.content_sha256 = digest  # what a downloaded policy names, so that it runs on this backbone only
    return b


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
