"""Random-weight LeRobot checkpoints of a chosen size, in the layout the fixtures (written by lerobot)
have: for benchmarks and the GPU check, where a SmolVLA- or π0-shaped policy is wanted at a size no
fixture has (no weights are downloaded; every tensor is drawn here, and labelled so in the config).

`random_checkpoint(family, shape, out)` takes the fixture checkpoint of the family
(tests/fixtures/lerobot_vla) as the template for everything that is not a tensor (config.json, the
processor files and statistics, the VLM/tokenizer directory) and writes tensors of the shape's sizes:
the VLM's by the family's naming rules, the expert's from vlamux's own expert module of those sizes
(whose names are lerobot's: it loads lerobot's checkpoints strictly).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from vlamux.model.vla.checkpoint import CONFIG, VLM_PREFIX, WEIGHTS
from vlamux.model.vla.experts import build_expert
from vlamux.model.vla.vlm import PI0_HEADS

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "lerobot_vla"
VLM_ASSET = {"smolvla": "smolvlm2_tiny", "pi0": "paligemma_tokenizer", "pi05": "paligemma_tokenizer"}


@dataclass(frozen=True)
class Shape:
    """A policy's sizes: the VLM's language model (width, layers kept, MLP, heads, key/value heads, head
    width), its vision tower (width, layers, MLP, heads) and the expert (width, MLP)."""

    width: int
    layers: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int
    v_width: int
    v_layers: int
    v_mlp: int
    v_heads: int
    e_width: int
    e_mlp: int


# "tiny": the fixtures' sizes; "small": a few million parameters, for this CPU; the two named after the
# released policies: their published sizes (SmolVLA 450M: SmolVLM2-500M's first 16 layers, a 0.75x
# expert; π0 3.3B: PaliGemma's Gemma 2B and SigLIP so400m, a Gemma 300M expert).
SHAPES = {
    "smolvla": {"tiny": Shape(64, 4, 128, 4, 2, 16, 32, 2, 64, 2, 48, 256),
                "small": Shape(256, 8, 1024, 4, 2, 64, 128, 4, 512, 4, 192, 768),
                "smolvla-450m": Shape(960, 16, 2560, 15, 5, 64, 768, 12, 3072, 12, 720, 2048)},
    "pi0": {"tiny": Shape(64, 3, 128, PI0_HEADS, 1, 16, 64, 2, 128, 16, 48, 96),
            "small": Shape(256, 6, 1024, PI0_HEADS, 1, 32, 128, 4, 512, 16, 192, 768),
            "pi0-3b": Shape(2048, 18, 16384, PI0_HEADS, 1, 256, 1152, 27, 4304, 16, 1024, 4096)},
}


def _vlm_shapes(family: str, s: Shape, vocab: int, patch: int, positions: int, scale: int) -> dict[str, tuple]:
    """Every VLM tensor's name (without the family's prefix) and shape."""
    out: dict[str, tuple] = {}
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    if family == "smolvla":
        t, v = "model.text_model.", "model.vision_model."
        out[t + "embed_tokens.weight"] = (vocab, s.width)
        out[t + "norm.weight"] = (s.width,)
        out["model.connector.modality_projection.proj.weight"] = (s.width, s.v_width * scale * scale)
    else:
        t, v = "model.language_model.", "model.vision_tower.vision_model."
        out[t + "norm.weight"] = (s.width,)
        out["model.multi_modal_projector.linear.weight"] = (s.width, s.v_width)
        out["model.multi_modal_projector.linear.bias"] = (s.width,)
    out["lm_head.weight"] = (vocab, s.width)
    for i in range(s.layers):
        p = f"{t}layers.{i}."
        out.update({p + "input_layernorm.weight": (s.width,), p + "post_attention_layernorm.weight": (s.width,),
                    p + "self_attn.q_proj.weight": (q, s.width), p + "self_attn.k_proj.weight": (kv, s.width),
                    p + "self_attn.v_proj.weight": (kv, s.width), p + "self_attn.o_proj.weight": (s.width, q),
                    p + "mlp.gate_proj.weight": (s.mlp, s.width), p + "mlp.up_proj.weight": (s.mlp, s.width),
                    p + "mlp.down_proj.weight": (s.width, s.mlp)})
    out[v + "embeddings.patch_embedding.weight"] = (s.v_width, 3, patch, patch)
    out[v + "embeddings.patch_embedding.bias"] = (s.v_width,)
    out[v + "embeddings.position_embedding.weight"] = (positions, s.v_width)
    out[v + "post_layernorm.weight"] = out[v + "post_layernorm.bias"] = (s.v_width,)
    for i in range(s.v_layers):
        p = f"{v}encoder.layers.{i}."
        for n in ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.out_proj", "mlp.fc2"):
            out[p + n + ".bias"] = (s.v_width,)
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"):
            out[p + n + ".weight"] = (s.v_width, s.v_width)
        out[p + "layer_norm1.weight"] = out[p + "layer_norm2.weight"] = (s.v_width,)
        out[p + "mlp.fc1.weight"], out[p + "mlp.fc1.bias"] = (s.v_mlp, s.v_width), (s.v_mlp,)
        out[p + "mlp.fc2.weight"] = (s.v_width, s.v_mlp)
    return out


def _draw(shapes: dict[str, tuple], g: torch.Generator, dtype: torch.dtype) -> dict[str, Tensor]:
    """Norm weights near their identity, everything else small: a forward stays finite at any depth.
    Drawn on the generator's device (a GPU draws a 3B model in a second), handed back on the host."""
    out, dev = {}, g.device
    for name, shape in shapes.items():
        if len(shape) == 1:
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            x = base + 0.02 * torch.randn(shape, generator=g, device=dev)
        else:
            x = torch.randn(shape, generator=g, device=dev) * (0.5 / shape[-1] ** 0.5)
        out[name] = x.to(dtype).to("cpu")
    return out


def random_checkpoint(family: str, shape: str, out: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> tuple[Path, Path]:
    """Write a random-weight `family` checkpoint of size `shape` (SHAPES) to `out`/ckpt, and the VLM
    directory it names to `out`/vlm; returns (checkpoint dir, VLM dir). `device`: where the weights are
    drawn (the same seed draws other numbers on another device)."""
    s = SHAPES["smolvla" if family == "smolvla" else "pi0"][shape]
    template = FIXTURES / family
    out = Path(out)
    ckpt, vlm_dir = out / "ckpt", out / "vlm"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    shutil.copytree(template, ckpt, ignore=shutil.ignore_patterns(WEIGHTS))
    if vlm_dir.exists():
        shutil.rmtree(vlm_dir)
    shutil.copytree(FIXTURES / "assets" / VLM_ASSET[family], vlm_dir)
    config = json.loads((ckpt / CONFIG).read_text())
    config["vlamux_random_weights"] = f"{shape}, seed {seed}: random weights, not a trained policy"
    g = torch.Generator(device=device).manual_seed(seed)
    if family == "smolvla":
        vcfg = json.loads((vlm_dir / CONFIG).read_text())
        vcfg["text_config"].update(hidden_size=s.width, intermediate_size=s.mlp, num_attention_heads=s.heads,
                                   num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                                   num_hidden_layers=max(s.layers, vcfg["text_config"]["num_hidden_layers"]))
        vcfg["vision_config"].update(hidden_size=s.v_width, intermediate_size=s.v_mlp, num_attention_heads=s.v_heads,
                                     num_hidden_layers=s.v_layers)
        (vlm_dir / CONFIG).write_text(json.dumps(vcfg, indent=2))
        config["num_vlm_layers"] = s.layers
        vc = vcfg["vision_config"]
        patch, positions, scale = vc["patch_size"], (vc["image_size"] // vc["patch_size"]) ** 2, vcfg["scale_factor"]
        vocab = vcfg["text_config"]["vocab_size"]
        dims = {"family": family, "width": s.e_width, "action_in": config.get("max_action_dim", 32),
                "head_dim": s.head_dim, "chunk": config.get("chunk_size", 50), "steps": config.get("num_steps", 10),
                "layers": s.layers, "mlp": s.e_mlp, "heads": s.heads, "kv_heads": s.kv_heads,
                "every_n": config.get("self_attn_every_n_layers", 2), "state_in": config.get("max_state_dim", 32),
                "prefix_dim": s.width, "eps": 1e-5}
    else:
        patch, side = 14, config.get("image_resolution", [224, 224])[0] // 14
        positions, scale, vocab = side * side, 1, 505 if shape == "tiny" else 505
        dims = {"family": family, "width": s.e_width, "action_in": config.get("max_action_dim", 32),
                "head_dim": s.head_dim, "chunk": config.get("chunk_size", 50), "steps": config.get("num_inference_steps", 10),
                "layers": s.layers, "mlp": s.e_mlp, "heads": PI0_HEADS, "kv_heads": s.kv_heads, "vocab": vocab}
        if family == "pi0":
            dims["state_in"] = config.get("max_state_dim", 32)
    (ckpt / CONFIG).write_text(json.dumps(config, indent=4))
    prefix = VLM_PREFIX[family]
    tensors = {prefix + k: v for k, v in _draw(_vlm_shapes(family, s, vocab, patch, positions, scale), g,
                                                dtype).items()}
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        expert = build_expert(dims)
    expert_shapes = {k: tuple(v.shape) for k, v in expert.state_dict().items()}
    tensors.update({"model." + k: v for k, v in _draw(expert_shapes, g, dtype).items()})
    metadata = {"format": "pt"}
    if family != "smolvla":  # π0 stores its tied embedding once, as lm_head, and says so in the header
        metadata[prefix + "model.language_model.embed_tokens.weight"] = prefix + "lm_head.weight"
    save_file(tensors, str(ckpt / WEIGHTS), metadata=metadata)
    return ckpt, vlm_dir
