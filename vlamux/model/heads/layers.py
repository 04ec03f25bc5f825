"""Building blocks shared by the action heads: a decoder whose tokens
self-attend and cross-attend to a `VLAFeature`, optionally modulated by a
conditioning vector (adaLN-zero, as in DiT).

Every layer here works over any number of leading dimensions, and with
*stacked* parameters: a `Linear` whose weight is [N, out, in] (N tenants'
weights, as `vlamux.model.fused` installs them) maps inputs [N, ..., in] to
[N, ..., out], each tenant's rows through its own weights. One head
implementation therefore serves one tenant's call and N tenants' fused call.
Plain `torch.func.vmap` would too, but its batching rule for `linear` was
slower than the per-tenant loop on a CPU (a bmm, a multiply and two adds in
place of one baddbmm), which defeats the point of fusing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlamux.model.feature import VLAFeature


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state_dict) that also applies stacked weights [N, out, in]."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if w.dim() == 2:
            return F.linear(x, w, self.bias)
        n = w.shape[0]
        flat = x.reshape(n, -1, x.shape[-1])
        bias = self.bias[:, None] if self.bias is not None else flat.new_zeros(())
        return torch.baddbmm(bias, flat, w.transpose(1, 2)).view(*x.shape[:-1], w.shape[1])


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that also applies stacked affine parameters [N, d] to inputs [N, ..., d]."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if w is None or w.dim() == 1:
            return super().forward(x)
        shape = (w.shape[0],) + (1,) * (x.dim() - 2) + (w.shape[1],)
        y = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        return y * w.view(shape) + self.bias.view(shape)


def broadcast_param(param: Tensor, plain_dims: int, like: Tensor) -> Tensor:
    """A head parameter (plain: `plain_dims` dims; stacked: one more, N first) shaped to broadcast
    against activations `like` [..., *param's shape]: a stacked one gets singleton dims after N."""
    if param.dim() == plain_dims:
        return param
    return param.view(param.shape[0], *([1] * (like.dim() - plain_dims - 1)), *param.shape[1:])


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, kv_dim: int | None = None):
        super().__init__()
        self.n_heads = n_heads
        self.q = Linear(dim, dim)
        self.kv = Linear(kv_dim or dim, 2 * dim)
        self.out = Linear(dim, dim)

    def forward(self, x: Tensor, kv: Tensor, key_mask: Tensor | None = None) -> Tensor:
        """x [..., n, d] attends to kv [..., m, d]; key_mask [..., m] (True: attend)."""
        *lead, n, d = x.shape
        m, h = kv.shape[-2], self.n_heads
        q = self.q(x).reshape(-1, n, h, d // h).transpose(1, 2)
        k, v = self.kv(kv).reshape(-1, m, 2, h, d // h).permute(2, 0, 3, 1, 4)
        mask = None if key_mask is None else key_mask.reshape(-1, 1, 1, m)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(a.transpose(1, 2).reshape(*lead, n, d))


class DecoderBlock(nn.Module):
    """Self-attention, cross-attention to the features, MLP; pre-LN; adaLN-zero if `cond_dim`."""

    def __init__(self, dim: int, n_heads: int, cond_dim: int = 0):
        super().__init__()
        self.norms = nn.ModuleList(LayerNorm(dim, elementwise_affine=not cond_dim) for _ in range(3))
        self.self_attn = Attention(dim, n_heads)
        self.cross_attn = Attention(dim, n_heads)
        self.mlp = nn.Sequential(Linear(dim, 4 * dim), nn.GELU(), Linear(4 * dim, dim))
        self.modulation = None
        if cond_dim:
            # shift, scale, gate for each of the three sub-layers; zero-init so a block starts as identity.
            self.modulation = Linear(cond_dim, 9 * dim)
            nn.init.zeros_(self.modulation.weight)
            nn.init.zeros_(self.modulation.bias)

    def forward(self, x: Tensor, memory: Tensor, memory_mask: Tensor, cond: Tensor | None = None) -> Tensor:
        """x [..., n, dim] decoder tokens; memory [..., m, dim]; cond [..., cond_dim]."""
        if self.modulation is None:
            mods = [(None, None, None)] * 3
        else:
            chunks = self.modulation(F.silu(cond)).unsqueeze(-2).chunk(9, dim=-1)
            mods = [chunks[i:i + 3] for i in range(0, 9, 3)]
        sublayers = (
            lambda h: self.self_attn(h, h),
            lambda h: self.cross_attn(h, memory, memory_mask),
            self.mlp,
        )
        for norm, fn, (shift, scale, gate) in zip(self.norms, sublayers, mods):
            h = norm(x)
            if shift is not None:
                h = h * (1 + scale) + shift
            h = fn(h)
            x = x + (h if gate is None else gate * h)
        return x


class ChunkDecoder(nn.Module):
    """Decodes a set of tokens against a VLAFeature.

    With `feature_layers` == depth, block i reads the backbone's i-th last
    layer (layer-wise cross-attention); with 0, every block reads the final
    hidden states.
    """

    def __init__(self, feature_dim: int, width: int, depth: int, n_heads: int, feature_layers: int = 0,
                 cond_dim: int = 0):
        super().__init__()
        self.feature_layers = feature_layers
        self.memory_proj = Linear(feature_dim, width)
        self.blocks = nn.ModuleList(DecoderBlock(width, n_heads, cond_dim) for _ in range(depth))
        self.norm = LayerNorm(width)

    def forward(self, tokens: Tensor, feature: VLAFeature, cond: Tensor | None = None) -> Tensor:
        if self.feature_layers:
            if len(feature.layers) < self.feature_layers:
                raise ValueError(f"head reads the last {self.feature_layers} backbone layers, the feature "
                                 f"carries {len(feature.layers)}")
            memories = [self.memory_proj(h) for h in feature.layers[-self.feature_layers:]]
        else:
            memories = [self.memory_proj(feature.hidden)] * len(self.blocks)
        for block, memory in zip(self.blocks, memories):
            tokens = block(tokens, memory, feature.mask, cond)
        return self.norm(tokens)


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10_000.0) -> Tensor:
    """Sinusoidal embedding of t in [0, 1] (scaled to [0, 1000]), [...] -> [..., dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=t.dtype) / half)
    args = (t * 1000.0)[..., None] * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def init_linear(module: nn.Module) -> None:
    """Trunc-normal weights, zero biases, for every Linear not already zero-initialised on purpose."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.weight.abs().sum() != 0:
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
