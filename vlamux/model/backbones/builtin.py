"""The built-in backbone family: a ViT patch encoder per camera, byte-level
instruction tokens and learned query tokens, fused by a pre-LayerNorm
transformer encoder. Download-free, seeded, and row-independent."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlamux.model.backbones.base import Backbone
from vlamux.model.batch import CanonicalBatch, InputSchema
from vlamux.model.feature import FeatureMeta, TokenType, VLAFeature
from vlamux.model.tokenizer import VOCAB_SIZE, ByteTokenizer


@dataclass(frozen=True)
class BuiltinConfig:
    dim: int
    depth: int
    n_heads: int
    image_size: int
    patch_size: int
    max_cameras: int = 3
    max_text_tokens: int = 64
    n_query: int = 8
    mlp_ratio: float = 4.0

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")

    @property
    def patches_per_camera(self) -> int:
        return (self.image_size // self.patch_size) ** 2


PRESETS: dict[str, BuiltinConfig] = {
    # ~0.9M parameters: fast enough for every test on 2 CPU cores.
    "tiny": BuiltinConfig(dim=128, depth=4, n_heads=4, image_size=32, patch_size=8, max_text_tokens=48, n_query=4),
    # ~21M parameters, 64 patches per 128x128 camera.
    "small": BuiltinConfig(dim=384, depth=12, n_heads=6, image_size=128, patch_size=16),
    # ~86M parameters, ViT-B/16 sized.
    "base": BuiltinConfig(dim=768, depth=12, n_heads=12, image_size=224, patch_size=16),
    # ~1.0B parameters (12x base): a VLM-sized stand-in for accelerator benchmarks; 4 GB in fp32, so
    # not for a small CPU machine.
    "xl": BuiltinConfig(dim=2048, depth=20, n_heads=16, image_size=224, patch_size=16),
}


class Block(nn.Module):
    """Pre-LayerNorm transformer block with a key-padding mask."""

    def __init__(self, dim: int, n_heads: int, mlp_ratio: float):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: Tensor, segments: list[tuple[int, int, Tensor]]) -> Tensor:
        """x: packed tokens [T, D] of consecutive segments (rows, length, key mask [rows, 1, 1, length]).

        Token-wise layers run on all tokens at once; attention runs per segment, over that
        segment's own length, so no request pays for another's padding.
        """
        d = x.shape[-1]
        qkv = self.qkv(self.norm1(x))
        outs = []
        # split, not sliced per segment: under autograd (adapters) each slice's backward would fill a
        # zero tensor of the whole group
        for part, (rows, length, mask) in zip(qkv.split([r * n for r, n, _ in segments]), segments):
            q, k, v = part.view(rows, length, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(rows * length, d))
        x = x + self.proj(outs[0] if len(outs) == 1 else torch.cat(outs))
        return x + self.mlp(self.norm2(x))


class BuiltinBackbone(Backbone):
    def __init__(self, config: BuiltinConfig, backbone_id: str):
        super().__init__()
        self.config = config
        self.backbone_id = backbone_id
        self.schema = InputSchema(config.image_size, config.max_cameras, config.max_text_tokens)
        self.tokenizer = ByteTokenizer(config.max_text_tokens)
        d, p = config.dim, config.patch_size
        self.patch_embed = nn.Conv2d(3, d, kernel_size=p, stride=p)
        self.patch_pos = nn.Parameter(torch.zeros(config.patches_per_camera, d))
        self.camera_embed = nn.Parameter(torch.zeros(config.max_cameras, d))
        self.token_embed = nn.Embedding(VOCAB_SIZE, d)
        self.text_pos = nn.Parameter(torch.zeros(config.max_text_tokens, d))
        self.query = nn.Parameter(torch.zeros(config.n_query, d))
        self.blocks = nn.ModuleList(Block(d, config.n_heads, config.mlp_ratio) for _ in range(config.depth))
        self.norm = nn.LayerNorm(d)
        self._init_weights()

    def _init_weights(self) -> None:
        for p in (self.patch_pos, self.camera_embed, self.text_pos, self.query):
            nn.init.trunc_normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)

    LORA_DEFAULT = ("qkv", "proj")

    def adaptable(self) -> dict:
        from vlamux.model.adapters import Target

        out = {}
        for i, block in enumerate(self.blocks):
            for name in ("qkv", "proj", "mlp.0", "mlp.2"):
                m = block.get_submodule(name)
                out[f"blocks.{i}.{name}"] = Target(f"blocks.{i}.{name}", m.in_features, m.out_features, i)
        return out

    def segments(self, batches: list[CanonicalBatch]) -> list[int]:
        """Packed tokens: a request's extent is its rows times its own token count."""
        c = self.config
        return [b.batch_size * (c.n_query + b.n_cameras * c.patches_per_camera + b.text_len) for b in batches]

    @property
    def meta(self) -> FeatureMeta:
        c = self.config
        return FeatureMeta(self.backbone_id, c.dim, c.depth, c.n_query, c.patches_per_camera)

    def forward(self, batch: CanonicalBatch, n_layers: int = 0) -> VLAFeature:
        return self.forward_group([batch], n_layers)[0]

    def forward_group(self, batches: list[CanonicalBatch], n_layers: int = 0) -> list[VLAFeature]:
        c = self.config
        if not 0 <= n_layers <= c.depth:
            raise ValueError(f"n_layers must be in [0, {c.depth}], got {n_layers}")
        embedded = [self._embed(b) for b in batches]
        x = torch.cat([e[0].reshape(-1, c.dim) for e in embedded])
        segments = _merge_equal_lengths([(e[0].shape[0], e[0].shape[1], e[1]) for e in embedded])
        kept = []
        for i, block in enumerate(self.blocks):
            x = block(x, segments)
            if i >= c.depth - n_layers:
                kept.append(x)
        x = self.norm(x)
        sizes = [e[1].numel() for e in embedded]
        pieces = [t.split(sizes) for t in (x, *kept)]
        out = []
        for i, (h, mask, token_type) in enumerate(embedded):
            rows, length = mask.shape
            out.append(VLAFeature(pieces[0][i].view(rows, length, c.dim), mask, token_type, self.meta,
                                  tuple(p[i].view(rows, length, c.dim) for p in pieces[1:])))
        return out

    def _embed(self, batch: CanonicalBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Input tokens [B, L, D], mask [B, L] and token types [B, L] of one request's batch."""
        c = self.config
        b, k, t = batch.batch_size, batch.n_cameras, batch.text_len
        if k > c.max_cameras or t > c.max_text_tokens:
            raise ValueError(f"batch has {k} cameras / {t} tokens; limits {c.max_cameras} / {c.max_text_tokens}")
        pixels = batch.pixels.to(self.patch_pos.dtype)
        patches = self.patch_embed(pixels.flatten(0, 1)).flatten(2).transpose(1, 2)  # [B*K, P, D]
        patches = patches.view(b, k, -1, c.dim) + self.patch_pos + self.camera_embed[:k, None]
        text = self.token_embed(batch.tokens) + self.text_pos[:t]
        x = torch.cat([self.query.expand(b, -1, -1), patches.flatten(1, 2), text], dim=1)
        p, dev = c.patches_per_camera, x.device
        mask = torch.cat([
            torch.ones(b, c.n_query, dtype=torch.bool, device=dev),
            batch.camera_mask.repeat_interleave(p, dim=1),
            batch.token_mask,
        ], dim=1)
        token_type = torch.cat([
            torch.full((c.n_query,), TokenType.QUERY, device=dev),
            (TokenType.CAMERA + torch.arange(k, device=dev)).repeat_interleave(p),
            torch.full((t,), TokenType.TEXT, device=dev),
        ]).expand(b, -1)
        return x, mask, token_type


def _merge_equal_lengths(segments: list[tuple[int, int, Tensor]]) -> list[tuple[int, int, Tensor]]:
    """Adjacent segments of equal length share one attention call; masks become key masks [rows, 1, 1, L]."""
    merged: list[tuple[int, int, list[Tensor]]] = []
    for rows, length, mask in segments:
        if merged and merged[-1][1] == length:
            merged[-1] = (merged[-1][0] + rows, length, merged[-1][2] + [mask])
        else:
            merged.append((rows, length, [mask]))
    # Keys only: a padded query row still attends to real keys, so no row is all-masked.
    return [(rows, length, torch.cat(masks)[:, None, None, :]) for rows, length, masks in merged]


def builtin_config_dict(config: BuiltinConfig) -> dict:
    return asdict(config)
