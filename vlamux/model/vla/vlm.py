"""The VLMs the imported policies share: SmolVLM2 (SmolVLA) and PaliGemma (π0, π0.5), as far as the
policies run them. Their modules carry the checkpoints' key names; their sizes come from the tensors
(and, for SmolVLM2, from the model directory's config that the checkpoint names).

`prefix_kv` runs the prefix (image tokens, language tokens, and any tenant tokens a caller placed in
it) through the language layers once and keeps each layer's keys (after RoPE) and values: what every
flow step of every tenant's expert reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from vlamux.errors import InvalidInputError
from vlamux.model.vla.layers import Box, DecoderLayer, att_2d_masks, attention, rope
from vlamux.model.vla.vision import SmolVLMConnector, VisionTower

PALIGEMMA_VISION_HEADS = 16  # PaliGemma's SigLIP: not in the tensors (lerobot builds it from its default config)
PI0_HEADS = 8  # π0's Gemma layout: 8 query heads over 1 key/value head, whatever the width


@dataclass
class PrefixKV:
    """Each language layer's keys (after RoPE) and values of a batch's prefix, [B, Lp, Hkv, D] each, its
    real tokens (`pad`, [B, Lp]) and the number of them per row."""

    keys: list[Tensor]
    values: list[Tensor]
    pad: Tensor

    @property
    def n_valid(self) -> Tensor:
        return self.pad.sum(dim=1)

    def select(self, rows: slice) -> PrefixKV:
        return PrefixKV([k[rows] for k in self.keys], [v[rows] for v in self.values], self.pad[rows])

    def to(self, dtype: torch.dtype) -> PrefixKV:
        if not self.keys or self.keys[0].dtype == dtype:
            return self
        return PrefixKV([k.to(dtype) for k in self.keys], [v.to(dtype) for v in self.values], self.pad)


class VLM(nn.Module):
    """What the experts need of a VLM: its embeddings and its language layers' shape."""

    text_dim: int
    heads: int
    kv_heads: int
    head_dim: int

    def embed_images(self, pixels: Tensor) -> Tensor:
        raise NotImplementedError

    def embed_text(self, ids: Tensor) -> Tensor:
        raise NotImplementedError


class SmolVLM(VLM):
    """`model.vision_model`, `model.connector`, `model.text_model` (embed_tokens, the kept layers, norm),
    `lm_head`; image and language embeddings scaled by √width."""

    def __init__(self, tensors: dict[str, Tensor], config: dict):
        super().__init__()
        vc, tc = config.get("vision_config", {}), config.get("text_config", {})
        t = "model.text_model."
        n_layers = 1 + max(int(k[len(t) + 7:].split(".")[0]) for k in tensors if k.startswith(t + "layers."))
        self.text_dim = tensors[t + "embed_tokens.weight"].shape[1]
        self.heads, self.kv_heads = int(tc["num_attention_heads"]), int(tc["num_key_value_heads"])
        self.head_dim = int(tc.get("head_dim") or self.text_dim // self.heads)
        mlp = tensors[t + "layers.0.mlp.gate_proj.weight"].shape[0]
        eps = float(tc.get("rms_norm_eps", 1e-5))
        v = "model.vision_model."
        vdim = tensors[v + "embeddings.patch_embedding.weight"].shape[0]
        patch = tensors[v + "embeddings.patch_embedding.weight"].shape[-1]
        v_layers = 1 + max(int(k[len(v) + 15:].split(".")[0]) for k in tensors if k.startswith(v + "encoder.layers."))
        vision = VisionTower(vdim, v_layers, int(vc["num_attention_heads"]),
                             tensors[v + "encoder.layers.0.mlp.fc1.weight"].shape[0], patch,
                             tensors[v + "embeddings.position_embedding.weight"].shape[0], bucketed=True,
                             image_size=int(vc.get("image_size", patch * 4)))
        vocab = tensors[t + "embed_tokens.weight"].shape[0]
        layers = nn.ModuleList(DecoderLayer(self.text_dim, self.heads, self.kv_heads, self.head_dim, mlp,
                                            gemma=False, eps=eps) for _ in range(n_layers))
        self.model = Box(vision_model=vision, connector=SmolVLMConnector(vdim, self.text_dim,
                                                                         int(config.get("scale_factor", 2))),
                         text_model=Box(embed_tokens=nn.Embedding(vocab, self.text_dim), layers=layers,
                                        norm=_Weight(self.text_dim, 1.0)))
        self.lm_head = nn.Linear(self.text_dim, vocab, bias=False)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.text_model.layers

    def embed_images(self, pixels: Tensor) -> Tensor:
        return self.model.connector(self.model.vision_model(pixels)) * self.text_dim ** 0.5

    def embed_text(self, ids: Tensor) -> Tensor:
        return self.model.text_model.embed_tokens(ids) * self.text_dim ** 0.5


class PaliGemma(VLM):
    """`model.vision_tower.vision_model`, `model.multi_modal_projector.linear`, `model.language_model`
    (layers, norm), `lm_head` (also the token embedding: tied); language embeddings scaled by √width,
    image embeddings not."""

    def __init__(self, tensors: dict[str, Tensor]):
        super().__init__()
        t, v = "model.language_model.", "model.vision_tower.vision_model."
        n_layers = 1 + max(int(k[len(t) + 7:].split(".")[0]) for k in tensors if k.startswith(t + "layers."))
        vocab, self.text_dim = tensors["lm_head.weight"].shape
        q = tensors[t + "layers.0.self_attn.q_proj.weight"].shape[0]
        self.heads, self.head_dim = PI0_HEADS, q // PI0_HEADS
        self.kv_heads = tensors[t + "layers.0.self_attn.k_proj.weight"].shape[0] // self.head_dim
        mlp = tensors[t + "layers.0.mlp.gate_proj.weight"].shape[0]
        vdim, _, patch, _ = tensors[v + "embeddings.patch_embedding.weight"].shape
        positions = tensors[v + "embeddings.position_embedding.weight"].shape[0]
        v_layers = 1 + max(int(k[len(v) + 15:].split(".")[0]) for k in tensors if k.startswith(v + "encoder.layers."))
        vision = VisionTower(vdim, v_layers, PALIGEMMA_VISION_HEADS, tensors[v + "encoder.layers.0.mlp.fc1.weight"].shape[0],
                             patch, positions, bucketed=False, image_size=int(round(positions ** 0.5)) * patch)
        layers = nn.ModuleList(DecoderLayer(self.text_dim, self.heads, self.kv_heads, self.head_dim, mlp,
                                            gemma=True, eps=1e-6) for _ in range(n_layers))
        proj_out = tensors["model.multi_modal_projector.linear.weight"].shape[0]
        self.model = Box(vision_tower=Box(vision_model=vision),
                         multi_modal_projector=Box(linear=nn.Linear(vdim, proj_out)),
                         language_model=Box(layers=layers, norm=_Weight(self.text_dim, 0.0)))
        self.lm_head = nn.Linear(self.text_dim, vocab, bias=False)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.language_model.layers

    def embed_images(self, pixels: Tensor) -> Tensor:
        return self.model.multi_modal_projector.linear(self.model.vision_tower.vision_model(pixels))

    def embed_text(self, ids: Tensor) -> Tensor:
        return self.lm_head.weight[ids] * self.text_dim ** 0.5


class _Weight(nn.Module):
    """A final norm the policies never apply, kept so the VLM's tensors round-trip whole."""

    def __init__(self, dim: int, value: float):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), value))


def build_vlm(family: str, tensors: dict[str, Tensor], vlm_dir: Path | None) -> VLM:
    """The family's VLM, its weights `tensors` (the checkpoint's, without the VLM prefix). SmolVLM2 reads
    its head counts and vision settings from `vlm_dir`'s config.json (the model directory the checkpoint
    names by hub id)."""
    if family == "smolvla":
        if vlm_dir is None or not (Path(vlm_dir) / "config.json").is_file():
            raise InvalidInputError(f"vlm: {vlm_dir}: no config.json of the SmolVLM2 model directory")
        vlm = SmolVLM(tensors, json.loads((Path(vlm_dir) / "config.json").read_text()))
    else:
        vlm = PaliGemma(tensors)
    missing, unexpected = vlm.load_state_dict(tensors, strict=False)
    if unexpected or missing:
        raise InvalidInputError(f"the checkpoint's VLM does not fit its family's layout: missing {missing[:4]}, "
                                f"unexpected {unexpected[:4]}")
    return vlm.eval().requires_grad_(False)


def prefix_inputs(cams: list[Tensor], text: Tensor, lang_mask: Tensor, own: Tensor | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """A batch's prefix as lerobot lays it out: each camera's tokens, the language tokens, then the
    tenant's own tokens (SmolVLA's state), which see the prefix while nothing in it sees them. Returns
    (tokens [B, Lp, D], pad [B, Lp], att [B, Lp]): `prefix_kv`'s inputs."""
    n, dev = text.shape[0], text.device
    parts = [*cams, text] + ([own.to(text.dtype)] if own is not None else [])
    pad = [torch.ones(n, c.shape[1], dtype=torch.bool, device=dev) for c in cams] + [lang_mask]
    if own is not None:
        pad.append(torch.ones(n, own.shape[1], dtype=torch.bool, device=dev))
    pad_t = torch.cat(pad, dim=1)
    att = torch.zeros_like(pad_t, dtype=torch.long)
    if own is not None:
        att[:, -own.shape[1]:] = 1
    return torch.cat(parts, dim=1), pad_t, att


def prefix_kv(vlm: VLM, tokens: Tensor, pad: Tensor, att: Tensor, hidden: bool = False):
    """Run the prefix `tokens` [B, Lp, D] (real where `pad`, blocks as `att`: lerobot's masks) through
    the language layers; each layer's keys after RoPE and its values. Positions count real tokens.
    hidden: also the last layer's output [B, Lp, D] (what a head reading hidden states takes)."""
    positions = pad.long().cumsum(dim=1) - 1
    mask = att_2d_masks(pad, att)
    x, keys, values = tokens, [], []
    for layer in vlm.layers:
        h = layer.input_layernorm(x)
        a = layer.self_attn
        q = rope(a.q(h), positions)
        k, v = a.kv(h)
        k = rope(k, positions)
        keys.append(k)
        values.append(v)
        x = x + a.o_proj(attention(q, k, v, mask))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    kv = PrefixKV(keys, values, pad)
    return (kv, x) if hidden else kv
