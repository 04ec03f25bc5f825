"""The building blocks of the imported VLA policies, as plain modules whose parameter names are the
checkpoints' own (so a LeRobot checkpoint loads with `load_state_dict` and goes back out unchanged).

Numerics follow lerobot 0.4.4 (docs/LEROBOT_IMPORT.md): RMS norms with their variance in fp32 (Llama
multiplies by `w`, Gemma by `1 + w`), rotate-half RoPE on queries and keys with θ = 10000, eager
attention with grouped key/value heads, its softmax in fp32, and the masks of `make_att_2d_masks`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Box(nn.Module):
    """A container whose children carry a checkpoint's key names (`Box(model=Box(norm=...))` holds
    `model.norm.weight`)."""

    def __init__(self, **children: nn.Module):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class RMSNorm(nn.Module):
    """`x / rms(x)` times `weight` (Llama) or `1 + weight` (Gemma), computed in fp32."""

    def __init__(self, dim: int, eps: float, gemma: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps, self.gemma = eps, gemma

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        n = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        return (n * (1.0 + w) if self.gemma else n * w).to(x.dtype)


class AdaRMSNorm(nn.Module):
    """π0.5's adaptive norm: `n = x / rms(x)`, then `n (1 + scale) + shift` with (scale, shift, gate) =
    `dense(cond)` in that order; the gate goes back to the caller (gated residuals)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dense = nn.Linear(dim, 3 * dim)
        self.eps = eps

    def forward(self, x: Tensor, cond: Tensor) -> tuple[Tensor, Tensor]:
        x32 = x.float()
        n = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        scale, shift, gate = self.dense(cond)[:, None, :].chunk(3, dim=-1)
        return (n * (1.0 + scale.float()) + shift.float()).to(x.dtype), gate


def rope(x: Tensor, positions: Tensor, theta: float = 10000.0) -> Tensor:
    """Rotate-half RoPE of `x` [B, L, H, D] at `positions` [B, L], in fp32."""
    d = x.shape[-1]
    half = d // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) * 2.0 / d)
    ang = positions.to(torch.float32)[..., None] * inv  # [B, L, half]
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Eager attention: q [B, Lq, Hq, D] over k, v [B, Lk, Hkv, D] (query head h reads key/value head
    h // (Hq / Hkv)), `mask` [B, Lq, Lk] (True: may attend), softmax in fp32; [B, Lq, Hq·D]."""
    b, lq, hq, d = q.shape
    rep = hq // k.shape[2]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    # (.float() after too: under autocast the product comes back in the autocast dtype)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()).float() * d ** -0.5
    scores = scores.masked_fill(~mask[:, None], torch.finfo(torch.float32).min)
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, lq, hq * d)


def att_2d_masks(pad: Tensor, att: Tensor) -> Tensor:
    """lerobot's `make_att_2d_masks`: token i may attend to j when both are real (`pad`) and j's block
    (a 1 in `att` starts one) is not after i's. [B, N] each -> [B, N, N]."""
    blocks = att.long().cumsum(dim=1)
    return (blocks[:, None, :] <= blocks[:, :, None]) & pad[:, None, :] & pad[:, :, None]


class Attention(nn.Module):
    """q, k, v, o projections (no bias): the text and expert layers' `self_attn`."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, kv_in: int | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(kv_in or dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(kv_in or dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)

    def q(self, h: Tensor) -> Tensor:
        return self.q_proj(h).unflatten(-1, (self.heads, self.head_dim))

    def kv(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return (self.k_proj(h).unflatten(-1, (self.kv_heads, self.head_dim)),
                self.v_proj(h).unflatten(-1, (self.kv_heads, self.head_dim)))


class GatedMLP(nn.Module):
    """`down(act(gate(h)) * up(h))`: silu (Llama) or tanh-approximated GELU (Gemma)."""

    def __init__(self, dim: int, hidden: int, gelu: bool):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.gelu = gelu

    def forward(self, h: Tensor) -> Tensor:
        g = self.gate_proj(h)
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.down_proj(g * self.up_proj(h))


class DecoderLayer(nn.Module):
    """A Llama / Gemma block's weights (`input_layernorm`, `self_attn`, `post_attention_layernorm`,
    `mlp`); the callers run it (the prefix stores each layer's keys and values, the experts read them)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, mlp: int, gemma: bool, eps: float,
                 kv_in: int | None = None, adaptive: bool = False):
        super().__init__()
        norm = (lambda: AdaRMSNorm(dim, eps)) if adaptive else (lambda: RMSNorm(dim, eps, gemma))
        self.input_layernorm = norm()
        self.self_attn = Attention(dim, heads, kv_heads, head_dim, kv_in)
        self.post_attention_layernorm = norm()
        self.mlp = GatedMLP(dim, mlp, gelu=gemma)


class SiglipLayer(nn.Module):
    """A SigLIP encoder block (pre-LN, biased projections, tanh-GELU MLP, no mask)."""

    def __init__(self, dim: int, heads: int, mlp: int, eps: float = 1e-6):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = Box(q_proj=nn.Linear(dim, dim), k_proj=nn.Linear(dim, dim), v_proj=nn.Linear(dim, dim),
                             out_proj=nn.Linear(dim, dim))
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Box(fc1=nn.Linear(dim, mlp), fc2=nn.Linear(mlp, dim))
        self.heads = heads

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        a = self.self_attn
        h = self.layer_norm1(x)
        q, k, v = (p(h).unflatten(-1, (self.heads, d // self.heads)) for p in (a.q_proj, a.k_proj, a.v_proj))
        full = torch.ones(b, n, n, dtype=torch.bool, device=x.device)
        x = x + a.out_proj(attention(q, k, v, full))
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.layer_norm2(x)), approximate="tanh"))


def time_embedding(t: Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> Tensor:
    """The flow time's sin/cos embedding [B, dim] (sin first), computed in float64 as lerobot does."""
    frac = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** frac
    x = (2.0 * math.pi / period)[None, :] * t.to(torch.float64)[:, None]
    return torch.cat([torch.sin(x), torch.cos(x)], dim=1).to(torch.float32)
