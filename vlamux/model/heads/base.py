"""The action-head interface and its spec.

A head reads only a `VLAFeature` and the proprio state, and works in
normalised action space (the slot normalises and un-normalises). Every head
shares one shape: an optional state token followed by per-step tokens, run
through a `ChunkDecoder` against the features.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from vlamux.errors import InvalidInputError
from vlamux.model.feature import TokenType, VLAFeature
from vlamux.model.heads.layers import ChunkDecoder


@dataclass
class HeadSpec:
    kind: str
    action_dim: int
    horizon: int
    state_dim: int = 0
    width: int = 128
    depth: int = 2
    n_heads: int = 4
    feature_layers: int = 0  # 0: read the final hidden states; depth: block i reads the i-th last layer
    # Add the pooled instruction features to every decoder token, so the first cross-attention to the
    # cameras already knows what was asked (without it, heads on a frozen backbone ignore the instruction).
    instruction_cond: str = "add"  # none | add | adaln (adaln: +50% head parameters, no clear gain measured)
    options: dict = field(default_factory=dict)  # head-specific, see each head's DEFAULT_OPTIONS

    def __post_init__(self):
        for name in ("action_dim", "horizon", "width", "depth", "n_heads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"head spec: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.state_dim < 0:
            raise ValueError(f"head spec: state_dim must be >= 0, got {self.state_dim}")
        if self.width % self.n_heads:
            raise ValueError(f"head spec: width {self.width} is not a multiple of n_heads {self.n_heads}")
        if self.instruction_cond not in ("none", "add", "adaln"):
            raise ValueError(f"head spec: instruction_cond must be none, add or adaln, got {self.instruction_cond!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> HeadSpec:
        return HeadSpec(**json.loads(text))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x [B, H, ...] over the steps where mask [B, H] is True."""
    m = mask.to(x.dtype).view(*mask.shape, *([1] * (x.dim() - 2)))
    denom = (m.expand_as(x)).sum().clamp_min(1.0)
    return (x * m).sum() / denom


def instruction_summary(feature: VLAFeature) -> Tensor:
    """Mean of the instruction tokens' features [B, D] (zeros for a row without text)."""
    text = (feature.token_type == TokenType.TEXT) & feature.mask
    w = text.to(feature.hidden.dtype).unsqueeze(-1)
    return (feature.hidden * w).sum(1) / w.sum(1).clamp_min(1.0)


class ActionHead(nn.Module):
    kind: ClassVar[str]
    DEFAULT_OPTIONS: ClassVar[dict] = {}
    ACTION_NORM: ClassVar[str] = "mean_std"  # how the slot normalises actions for this head
    HAS_VALUE: ClassVar[bool] = False

    def __init__(self, spec: HeadSpec, feature_dim: int, cond_dim: int = 0):
        super().__init__()
        unknown = set(spec.options) - set(self.DEFAULT_OPTIONS)
        if unknown:
            raise ValueError(f"head spec: unknown options {sorted(unknown)} for kind {self.kind!r}; "
                             f"allowed: {sorted(self.DEFAULT_OPTIONS)}")
        self.spec = spec
        self.options = {**self.DEFAULT_OPTIONS, **spec.options}
        w = spec.width
        self.state_proj = nn.Linear(spec.state_dim, w) if spec.state_dim else None
        self.instruction_proj = None
        if spec.instruction_cond == "adaln":
            cond_dim = cond_dim or w
            self.instruction_proj = nn.Linear(feature_dim, cond_dim)
        elif spec.instruction_cond == "add":
            self.instruction_proj = nn.Linear(feature_dim, w)
        self.step_pos = nn.Parameter(torch.zeros(spec.horizon, w))
        self.decoder = ChunkDecoder(feature_dim, w, spec.depth, spec.n_heads, spec.feature_layers, cond_dim)
        self.value_head = nn.Linear(w, 1) if self.HAS_VALUE else None

    def decode(self, step_tokens: Tensor, feature: VLAFeature, state: Tensor | None,
               cond: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Per-step outputs [B, H, w] and a pooled summary [B, w]."""
        tokens = step_tokens + self.step_pos
        if self.state_proj is not None:
            tokens = torch.cat([self.state_proj(state)[:, None], tokens], dim=1)
        if self.instruction_proj is not None:
            text = self.instruction_proj(instruction_summary(feature))
            if self.spec.instruction_cond == "add":
                tokens = tokens + text[:, None]
            else:
                cond = text if cond is None else cond + text
        out = self.decoder(tokens, feature, cond)
        return out[:, -self.spec.horizon:], out.mean(dim=1)

    def value(self, pooled: Tensor) -> Tensor:
        # The critic reads the policy's features but does not train them: fitting a fresh critic
        # (PPO's warm-up on an SFT policy) would otherwise rewrite the decoder the actions come from.
        return self.value_head(pooled.detach()).squeeze(-1)

    def loss(self, feature: VLAFeature, state: Tensor | None, actions: Tensor, action_mask: Tensor,
             generator: torch.Generator) -> tuple[Tensor, dict[str, float]]:
        """Supervised loss for normalised `actions` [B, H, A]; metrics are plain floats."""
        raise NotImplementedError

    def sample(self, feature: VLAFeature, state: Tensor | None, generator: torch.Generator,
               deterministic: bool = False) -> dict[str, Tensor]:
        """{"actions": normalised [B, H, A], ...head-specific extras such as step_log_prob, value}."""
        raise NotImplementedError

    def evaluate(self, feature: VLAFeature, state: Tensor | None, actions: Tensor, action_mask: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
        """For RL: log-prob [B] and entropy [B] of normalised `actions` over the masked steps, value [B]."""
        raise InvalidInputError(f"head kind {self.kind!r} has no action log-probability, so it cannot be trained "
                                f"with RL; use a gaussian or bins head")
