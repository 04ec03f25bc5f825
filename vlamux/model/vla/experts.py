"""The action experts of the imported policies: a tenant's own module, reading the shared prefix's
per-layer keys and values (`PrefixKV`) and returning the flow's velocity for the noisy actions x_t at
time t. Their parameters carry the checkpoint's names without `model.`.

- SmolVLA: a narrower Llama whose layer i reads VLM layer i: even layers attend jointly over the
  prefix and the (causal) action tokens, odd layers cross-attend to the prefix's keys and values
  re-projected by the expert's own k/v; the state is a prefix token (`state_token`), not the expert's.
- π0: a Gemma expert attending jointly, every layer, over the prefix and its own [state, actions]
  tokens (actions bidirectional).
- π0.5: π0's expert without the state token, its norms adaptive (RMS, then scale, shift and a residual
  gate from the flow time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlamux.model.vla.layers import AdaRMSNorm, Box, DecoderLayer, RMSNorm, att_2d_masks, attention, rope, \
    time_embedding
from vlamux.model.vla.vlm import PI0_HEADS, PrefixKV


def _n_layers(tensors: dict[str, Tensor], prefix: str) -> int:
    return 1 + max(int(k[len(prefix):].split(".")[0]) for k in tensors if k.startswith(prefix))


class Expert(nn.Module):
    """`velocity(kv, x_t, t, state)`: the flow's velocity [B, T, A] for the padded actions x_t [B, T, A].
    `state_token(state)`: a prefix token of the tenant's own (SmolVLA), else None."""

    uses_state = False  # the suffix holds a state token (π0)
    chunk: int = 50

    def velocity(self, kv: PrefixKV, x_t: Tensor, t: Tensor, state: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def forward(self, keys: list[Tensor], values: list[Tensor], pad: Tensor, x_t: Tensor, t: Tensor,
                state: Tensor | None = None) -> Tensor:
        """`velocity` with the prefix as plain tensors (what torch.func maps over, for fused experts)."""
        return self.velocity(PrefixKV(list(keys), list(values), pad), x_t, t, state)

    def state_token(self, state: Tensor) -> Tensor | None:
        return None


class SmolVLAExpert(Expert):
    def __init__(self, d: dict):
        super().__init__()
        n, width = d["layers"], d["width"]
        self.cross = [i % d["every_n"] != 0 for i in range(n)]  # odd layers read the VLM's keys and values re-projected
        vlm_kv = d["kv_heads"] * d["head_dim"]
        layers = nn.ModuleList(DecoderLayer(width, d["heads"], d["kv_heads"], d["head_dim"], d["mlp"], gemma=False,
                                            eps=d["eps"], kv_in=vlm_kv if self.cross[i] else None) for i in range(n))
        self.vlm_with_expert = Box(lm_expert=Box(layers=layers, norm=RMSNorm(width, d["eps"], gemma=False)))
        self.state_proj = nn.Linear(d["state_in"], d["prefix_dim"])
        self.action_in_proj = nn.Linear(d["action_in"], width)
        self.action_out_proj = nn.Linear(width, d["action_in"])
        self.action_time_mlp_in = nn.Linear(2 * width, width)
        self.action_time_mlp_out = nn.Linear(width, width)
        self.width = width

    def state_token(self, state: Tensor) -> Tensor:
        return self.state_proj(state)[:, None, :]

    def velocity(self, kv: PrefixKV, x_t: Tensor, t: Tensor, state: Tensor | None = None) -> Tensor:
        b, n, _ = x_t.shape
        a = self.action_in_proj(x_t)
        te = time_embedding(t, self.width).to(a.dtype)[:, None, :].expand(b, n, self.width)
        y = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([a, te], dim=-1))))
        positions = kv.n_valid[:, None] + torch.arange(n, device=x_t.device)[None]
        causal = torch.ones(n, n, dtype=torch.bool, device=x_t.device).tril()[None].expand(b, n, n)
        joint = torch.cat([kv.pad[:, None, :].expand(b, n, -1), causal], dim=2)
        cross = kv.pad[:, None, :].expand(b, n, -1)
        local = torch.arange(n, device=x_t.device)[None].expand(b, n)  # cross layers number the actions from 0
        lp = kv.pad.shape[1]
        for i, layer in enumerate(self.vlm_with_expert.lm_expert.layers):
            h = layer.input_layernorm(y)
            att = layer.self_attn
            if self.cross[i]:  # the VLM's keys (after its RoPE) and values, through the expert's k/v
                q = rope(att.q(h), local)
                k = att.k_proj(kv.keys[i].reshape(b, lp, -1)).unflatten(-1, (att.kv_heads, att.head_dim))
                v = att.v_proj(kv.values[i].reshape(b, lp, -1)).unflatten(-1, (att.kv_heads, att.head_dim))
                out = attention(q, k, v, cross)
            else:
                q = rope(att.q(h), positions)
                k, v = att.kv(h)
                out = attention(q, torch.cat([kv.keys[i], rope(k, positions)], dim=1),
                                torch.cat([kv.values[i], v], dim=1), joint)
            y = y + att.o_proj(out)
            y = y + layer.mlp(layer.post_attention_layernorm(y))
        return self.action_out_proj(self.vlm_with_expert.lm_expert.norm(y))


class Pi0Expert(Expert):
    """π0's (and, `adaptive`, π0.5's) Gemma expert."""

    def __init__(self, d: dict):
        super().__init__()
        width, adaptive = d["width"], d["family"] == "pi05"
        layers = nn.ModuleList(DecoderLayer(width, d["heads"], d["kv_heads"], d["head_dim"], d["mlp"], gemma=True,
                                            eps=1e-6, adaptive=adaptive) for _ in range(d["layers"]))
        norm = AdaRMSNorm(width) if adaptive else RMSNorm(width, 1e-6, gemma=True)
        self.paligemma_with_expert = Box(gemma_expert=Box(model=Box(layers=layers, norm=norm),
                                                          lm_head=nn.Linear(width, d["vocab"], bias=False)))
        self.action_in_proj = nn.Linear(d["action_in"], width)
        self.action_out_proj = nn.Linear(width, d["action_in"])
        self.adaptive, self.width = adaptive, width
        if adaptive:  # π0.5: the time conditions the norms
            self.time_mlp_in = nn.Linear(width, width)
            self.time_mlp_out = nn.Linear(width, width)
        else:  # π0: the time joins each action token; the state is the suffix's first token
            self.state_proj = nn.Linear(d["state_in"], width)
            self.action_time_mlp_in = nn.Linear(2 * width, width)
            self.action_time_mlp_out = nn.Linear(width, width)
            self.uses_state = True

    def velocity(self, kv: PrefixKV, x_t: Tensor, t: Tensor, state: Tensor | None = None) -> Tensor:
        b, n, _ = x_t.shape
        a = self.action_in_proj(x_t)
        te = time_embedding(t, self.width).to(a.dtype)
        cond = None
        if self.adaptive:
            cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(te))))
            y, att_blocks = a, [1] + [0] * (n - 1)
        else:
            acts = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(
                torch.cat([a, te[:, None, :].expand(b, n, self.width)], dim=-1))))
            y, att_blocks = torch.cat([self.state_proj(state)[:, None, :], acts], dim=1), [1, 1] + [0] * (n - 1)
        ls = y.shape[1]
        own = torch.ones(b, ls, dtype=torch.bool, device=x_t.device)
        mask = torch.cat([kv.pad[:, None, :].expand(b, ls, -1),
                          att_2d_masks(own, torch.tensor(att_blocks, device=x_t.device)[None].expand(b, ls))], dim=2)
        positions = kv.n_valid[:, None] + torch.arange(ls, device=x_t.device)[None]
        expert = self.paligemma_with_expert.gemma_expert.model
        for i, layer in enumerate(expert.layers):
            h, gate1 = self._norm(layer.input_layernorm, y, cond)
            att = layer.self_attn
            q = rope(att.q(h), positions)
            k, v = att.kv(h)
            out = att.o_proj(attention(q, torch.cat([kv.keys[i], rope(k, positions)], dim=1),
                                       torch.cat([kv.values[i], v], dim=1), mask))
            y = y + (out if gate1 is None else out * gate1)
            h, gate2 = self._norm(layer.post_attention_layernorm, y, cond)
            out = layer.mlp(h)
            y = y + (out if gate2 is None else out * gate2)
        y, _ = self._norm(expert.norm, y, cond)
        return self.action_out_proj(y[:, -n:])

    @staticmethod
    def _norm(norm: nn.Module, x: Tensor, cond: Tensor | None) -> tuple[Tensor, Tensor | None]:
        return norm(x, cond) if cond is not None else (norm(x), None)


def expert_dims(family: str, tensors: dict[str, Tensor], config: dict, heads: int, kv_heads: int,
                head_dim: int) -> dict:
    """Everything that shapes a family's expert, read from its tensors (names without `model.`), its
    checkpoint's config and its VLM's attention layout: what a head spec carries (`options`), so the
    expert can be rebuilt without the checkpoint (a replica applying a policy version)."""
    common = {"family": family, "width": tensors["action_in_proj.weight"].shape[0],
              "action_in": tensors["action_in_proj.weight"].shape[1], "head_dim": head_dim,
              "chunk": int(config.get("chunk_size", 50)),
              "steps": int(config.get("num_steps", config.get("num_inference_steps", 10)))}
    if family == "smolvla":
        p = "vlm_with_expert.lm_expert.layers."
        return {**common, "layers": _n_layers(tensors, p), "mlp": tensors[p + "0.mlp.gate_proj.weight"].shape[0],
                "heads": heads, "kv_heads": kv_heads, "every_n": int(config.get("self_attn_every_n_layers", 2)),
                "state_in": tensors["state_proj.weight"].shape[1], "prefix_dim": tensors["state_proj.weight"].shape[0],
                "eps": 1e-5}
    p = "paligemma_with_expert.gemma_expert.model.layers."
    out = {**common, "layers": _n_layers(tensors, p), "mlp": tensors[p + "0.mlp.gate_proj.weight"].shape[0],
           "heads": PI0_HEADS, "kv_heads": tensors[p + "0.self_attn.k_proj.weight"].shape[0] // head_dim,
           "vocab": tensors["paligemma_with_expert.gemma_expert.lm_head.weight"].shape[0]}
    if family == "pi0":
        out["state_in"] = tensors["state_proj.weight"].shape[1]
    return out


def build_expert(dims: dict) -> Expert:
    """A family's expert of these dims (`expert_dims`), its weights not yet loaded."""
    expert = SmolVLAExpert(dims) if dims["family"] == "smolvla" else Pi0Expert(dims)
    expert.chunk = int(dims["chunk"])
    return expert
