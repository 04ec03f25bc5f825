"""The action-head interface and its spec.

A head reads only a `VLAFeature` and the proprio state, and works in
normalised action space (the slot normalises and un-normalises). Every head
shares one shape: an optional state token followed by per-step tokens, run
through a `ChunkDecoder` against the features.

Two rules make a head fusable with other tenants' heads of its architecture
(`vlamux.model.fused`): its maths works over any leading dimensions (one
tenant's [B, ...] or N tenants' [N, B, ...] with stacked parameters), and its
randomness is drawn up front by `draw`, on the host, from the tenant's own
generator, and passed in as tensors. Metrics are 0-d tensors: reading them
would synchronise the device, so the caller does it once per group.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from vlamux.errors import InvalidInputError
from vlamux.model.queries import MAX_QUERY_TOKENS
from vlamux.specs import Bound, SpecError, bounded, check
from vlamux.model.device import to_device
from vlamux.model.feature import TokenType, VLAFeature
from vlamux.model.heads.layers import ChunkDecoder, Linear, broadcast_param


# kind -> head class, filled by the package (vlamux.model.heads), which imports every head
HEADS: dict[str, type[ActionHead]] = {}
# heads a spec cannot ask for by hand: made by importing a pretrained policy (its expert), with its backbone
IMPORTED_HEADS: dict[str, type] = {}


@dataclass
class HeadSpec:
    kind: str  # one of vlamux.model.heads.HEADS (or an imported policy's, made by its importer)
    action_dim: int = bounded(lo=1, hi=1024)
    horizon: int = bounded(lo=1, hi=1024)
    state_dim: int = bounded(0, 0, 4096)
    width: int = bounded(128, 1, 4096)
    depth: int = bounded(2, 1, 64)
    n_heads: int = bounded(4, 1, 256)
    feature_layers: int = bounded(0, 0, 64)  # 0: read the final hidden states; depth: block i reads the i-th last layer
    # Add the pooled instruction features to every decoder token, so the first cross-attention to the
    # cameras already knows what was asked (without it, heads on a frozen backbone ignore the instruction).
    # adaln: +50% head parameters, no clear gain measured
    instruction_cond: str = bounded("add", choices=("none", "add", "adaln"))
    options: dict = field(default_factory=dict)  # head-specific: each head's DEFAULT_OPTIONS and OPTION_BOUNDS
    # A LoRA adapter on the backbone, part of the tenant's module: {kind: lora, rank, alpha, dropout,
    # target_modules, layers} (vlamux.model.adapters.LoRASpec); None: the head reads frozen features.
    adapter: dict | None = None
    # Learned query (action) tokens appended to a VLM backbone's prompt, part of the tenant's module
    # (vlamux.model.queries, StarVLA-OFT style); the head reads them among the features (type QUERY).
    query_tokens: int = bounded(0, 0, MAX_QUERY_TOKENS)

    def __post_init__(self):
        check(self)
        if self.width % self.n_heads:
            raise SpecError(f"width: {self.width} is not a multiple of n_heads {self.n_heads}")
        if self.feature_layers not in (0, self.depth):
            raise SpecError(f"feature_layers: must be 0 or depth ({self.depth}), got {self.feature_layers!r}")
        if not isinstance(self.options, dict):
            raise SpecError(f"options: expected a mapping, got {type(self.options).__name__}")
        if self.kind in HEADS:
            HEADS[self.kind].check_options(self.options)
        elif self.kind not in IMPORTED_HEADS:  # an importer's head takes the options its checkpoint gives
            raise SpecError(f"kind: unknown kind {self.kind!r}; choose one of {sorted(HEADS)}")
        if self.adapter is not None:
            from vlamux.model.adapters import LoRASpec

            self.adapter = LoRASpec.from_dict(self.adapter, where="adapter").to_dict()  # checked, one canonical form

    def to_json(self) -> str:
        d = asdict(self)
        if d["adapter"] is None:
            del d["adapter"]  # files written before adapters existed say the same
        if not d["query_tokens"]:
            del d["query_tokens"]  # likewise before query tokens
        return json.dumps(d, sort_keys=True)

    @property
    def lora(self):
        from vlamux.model.adapters import LoRASpec

        return None if self.adapter is None else LoRASpec.from_dict(self.adapter)

    @staticmethod
    def from_json(text: str) -> HeadSpec:
        return HeadSpec(**json.loads(text))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x [..., B, H, ...] over the steps where mask [..., B, H] is True: a 0-d tensor for one
    tenant's mask [B, H], one mean per tenant for stacked masks [N, B, H]."""
    m = mask.to(x.dtype).view(*mask.shape, *([1] * (x.dim() - mask.dim())))
    dims = tuple(range(mask.dim() - 2, x.dim()))
    denom = m.expand_as(x).sum(dims).clamp_min(1.0)
    return (x * m).sum(dims) / denom


def instruction_summary(feature: VLAFeature) -> Tensor:
    """Mean of the instruction tokens' features [..., B, D] (zeros for a row without text)."""
    text = (feature.token_type == TokenType.TEXT) & feature.mask
    w = text.to(feature.hidden.dtype).unsqueeze(-1)
    return (feature.hidden * w).sum(-2) / w.sum(-2).clamp_min(1.0)


def host_noise(draws: dict[str, Tensor], device) -> dict[str, Tensor]:
    """Host draws moved to the head's device (pinned, asynchronous where that is a GPU)."""
    return {k: to_device(v, device) for k, v in draws.items()}


class ActionHead(nn.Module):
    kind: ClassVar[str]
    DEFAULT_OPTIONS: ClassVar[dict] = {}
    OPTION_BOUNDS: ClassVar[dict[str, Bound]] = {}  # what each option takes (the spec checks it)
    INIT_OPTIONS: ClassVar[tuple] = ()  # options read only at initialisation: heads differing only there fuse
    ACTION_NORM: ClassVar[str] = "mean_std"  # how the slot normalises actions for this head
    HAS_VALUE: ClassVar[bool] = False
    EXPLORES: ClassVar[bool] = False  # samples with a FlowExploration (`draw(explore=)`): a flow policy's RL

    @classmethod
    def check_options(cls, options: dict) -> None:
        """A spec's options for this head: known, and each within its OPTION_BOUNDS."""
        for k, v in options.items():
            if k not in cls.DEFAULT_OPTIONS:
                raise SpecError(f"options.{k}: unknown option for kind {cls.kind!r}; allowed: "
                                f"{sorted(cls.DEFAULT_OPTIONS)}")
            bound = cls.OPTION_BOUNDS.get(k)
            why = bound.why(v, integer=isinstance(cls.DEFAULT_OPTIONS[k], int)) if bound is not None else None
            if why is not None:
                raise SpecError(f"options.{k}: {why}")

    def __init__(self, spec: HeadSpec, feature_dim: int, cond_dim: int = 0):
        super().__init__()
        self.spec = spec
        self.options = {**self.DEFAULT_OPTIONS, **spec.options}
        w = spec.width
        self.state_proj = Linear(spec.state_dim, w) if spec.state_dim else None
        self.instruction_proj = None
        if spec.instruction_cond == "adaln":
            cond_dim = cond_dim or w
            self.instruction_proj = Linear(feature_dim, cond_dim)
        elif spec.instruction_cond == "add":
            self.instruction_proj = Linear(feature_dim, w)
        self.step_pos = nn.Parameter(torch.zeros(spec.horizon, w))
        self.decoder = ChunkDecoder(feature_dim, w, spec.depth, spec.n_heads, spec.feature_layers, cond_dim)
        self.value_head = Linear(w, 1) if self.HAS_VALUE else None

    def step_tokens(self, feature: VLAFeature) -> Tensor:
        """Zeros [..., B, H, w] shaped like the rows of `feature` (one tenant's, or N tenants')."""
        return self.step_pos.new_zeros(*feature.hidden.shape[:-2], self.spec.horizon, self.spec.width)

    def decode(self, step_tokens: Tensor, feature: VLAFeature, state: Tensor | None,
               cond: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Per-step outputs [..., B, H, w] and a pooled summary [..., B, w]."""
        tokens = step_tokens + broadcast_param(self.step_pos, 2, step_tokens)
        if self.state_proj is not None:
            tokens = torch.cat([self.state_proj(state).unsqueeze(-2), tokens], dim=-2)
        if self.instruction_proj is not None:
            text = self.instruction_proj(instruction_summary(feature))
            if self.spec.instruction_cond == "add":
                tokens = tokens + text.unsqueeze(-2)
            else:
                cond = text if cond is None else cond + text
        out = self.decoder(tokens, feature, cond)
        return out[..., -self.spec.horizon:, :], out.mean(dim=-2)

    def value(self, pooled: Tensor) -> Tensor:
        # The critic reads the policy's features but does not train them: fitting a fresh critic
        # (PPO's warm-up on an SFT policy) would otherwise rewrite the decoder the actions come from.
        return self.value_head(pooled.detach()).squeeze(-1).float()

    # ---- randomness -------------------------------------------------------------------------------
    def draw(self, purpose: str, batch: int, generator: torch.Generator, deterministic: bool = False
             ) -> dict[str, Tensor]:
        """The random draws of one call (`purpose` "loss" or "sample") for `batch` rows, on the host
        from `generator` (a CPU generator: the same draws on any device, and a state that moves
        between devices unchanged; None: torch's global one). None by default."""
        return {}

    def _noise(self, purpose: str, actions_or_feature, generator, noise, deterministic=False) -> dict:
        if noise is not None:
            return noise
        ref = actions_or_feature.hidden if isinstance(actions_or_feature, VLAFeature) else actions_or_feature
        return host_noise(self.draw(purpose, ref.shape[0], generator, deterministic), ref.device)

    # ---- the head's maths ---------------------------------------------------------------------------
    def loss(self, feature: VLAFeature, state: Tensor | None, actions: Tensor, action_mask: Tensor,
             generator: torch.Generator | None = None, noise: dict | None = None
             ) -> tuple[Tensor, dict[str, Tensor]]:
        """Supervised loss for normalised `actions` [..., B, H, A] and 0-d (per tenant: [N]) metric
        tensors. `noise`: this call's draws (`draw("loss", ...)`), else drawn here from `generator`."""
        raise NotImplementedError

    def sample(self, feature: VLAFeature, state: Tensor | None, generator: torch.Generator | None = None,
               deterministic: bool = False, noise: dict | None = None) -> dict[str, Tensor]:
        """{"actions": normalised [..., B, H, A], ...head-specific extras such as step_log_prob, value}."""
        raise NotImplementedError

    def evaluate(self, feature: VLAFeature, state: Tensor | None, actions: Tensor, action_mask: Tensor,
                 sampled: dict[str, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """For RL: log-prob [..., B] and entropy [..., B] of normalised `actions` over the masked steps,
        value [..., B]. `sampled`: what the rollout's sample kept for the update besides the actions
        (`RL_SAMPLED`: a flow policy's chain), per row."""
        raise InvalidInputError(f"head kind {self.kind!r} has no action log-probability, so it cannot be trained "
                                f"with RL; use a gaussian or bins head")
