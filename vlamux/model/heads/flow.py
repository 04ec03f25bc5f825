"""GR00T/pi0-style flow matching: a small DiT, conditioned on the flow time by adaLN,
cross-attends to the features and predicts the velocity from noise to actions.

Convention (rectified flow): x_t = (1 - t) * noise + t * actions, velocity
v = actions - noise; sampling integrates t from 0 to 1 in K Euler steps.

For RL a request asks for exploration (`FlowExploration`): the chain becomes stochastic (Flow-SDE,
vlamux.model.heads.flow_sde) and the sample carries what the update scores, the chain and its
stochastic steps, with their log-probability. `options.critic` adds a value head (PPO's critic) on the
pooled features; GRPO needs none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlamux.errors import InvalidInputError
from vlamux.model.feature import VLAFeature
from vlamux.model.heads.base import ActionHead, masked_mean
from vlamux.model.heads.flow_sde import FlowExploration, chain_log_prob, draw_steps, drawn_log_prob, sample_chain
from vlamux.model.heads.layers import Linear, timestep_embedding
from vlamux.specs import Bound


def pooled_features(feature: VLAFeature) -> torch.Tensor:
    """The mean of the valid tokens' features [..., B, D]."""
    w = feature.mask.to(feature.hidden.dtype).unsqueeze(-1)
    return (feature.hidden * w).sum(-2) / w.sum(-2).clamp_min(1.0)


class FlowHead(ActionHead):
    kind = "flow"
    DEFAULT_OPTIONS = {"steps": 10, "critic": False}
    OPTION_BOUNDS = {"steps": Bound(1, 4096)}  # Euler steps of the sampler
    EXPLORES = True  # samples with a FlowExploration (RL)

    def __init__(self, spec, feature_dim):
        super().__init__(spec, feature_dim, cond_dim=spec.width)
        self.steps = int(self.options["steps"])
        if self.steps < 1:
            raise ValueError(f"head spec: options.steps must be >= 1, got {self.steps}")
        w = spec.width
        self.action_in = Linear(spec.action_dim, w)
        self.time_mlp = nn.Sequential(Linear(w, w), nn.SiLU(), Linear(w, w))
        self.out = Linear(w, spec.action_dim)
        if not isinstance(self.options["critic"], bool):
            raise ValueError(f"head spec: options.critic must be true or false, got {self.options['critic']!r}")
        if self.options["critic"]:  # PPO's critic: its own layer on the pooled features (and the state)
            self.critic_in = Linear(feature_dim, w)
            self.value_head = Linear(w, 1)

    def chain_shape(self) -> tuple[int, int, int]:
        """A sampled chain's shape per row: (steps + 1, horizon, action dims)."""
        return self.steps + 1, self.spec.horizon, self.spec.action_dim

    @property
    def has_value(self) -> bool:
        return self.value_head is not None

    def critic(self, feature, state):
        """The value [..., B]; it reads the policy's features and state token without training them."""
        h = self.critic_in(pooled_features(feature).detach())
        if self.state_proj is not None:
            h = h + self.state_proj(state).detach()
        return self.value_head(F.silu(h)).squeeze(-1).float()

    def velocity(self, feature, state, x, t):
        cond = self.time_mlp(timestep_embedding(t, self.spec.width))
        steps, _ = self.decode(self.action_in(x), feature, state, cond)
        return self.out(steps)

    def draw(self, purpose, batch, generator, deterministic=False, explore: FlowExploration | None = None):
        shape = (batch, self.spec.horizon, self.spec.action_dim)
        if purpose == "loss":  # the noise first, then the flow times (the order is part of the RNG stream)
            noise = torch.randn(shape, generator=generator)
            return {"noise": noise, "t": torch.rand(batch, generator=generator)}
        if deterministic:
            return {}
        x0 = {"x0": torch.randn(shape, generator=generator)}
        if explore is None:
            return x0
        return {**x0, **draw_steps(explore, batch, self.steps, shape[1:], generator)}

    def loss(self, feature, state, actions, action_mask, generator=None, noise=None):
        draws = self._noise("loss", actions, generator, noise)
        eps, t = draws["noise"].to(actions.dtype), draws["t"].to(actions.dtype)
        x_t = (1 - t)[..., None, None] * eps + t[..., None, None] * actions
        mse = masked_mean((self.velocity(feature, state, x_t, t) - (actions - eps)).pow(2), action_mask)
        return mse, {"velocity_mse": mse.detach()}

    def sample(self, feature, state, generator=None, deterministic=False, noise=None):
        lead = feature.hidden.shape[:-2]
        s = self.spec
        draws = {} if deterministic else self._noise("sample", feature, generator, noise)
        if deterministic:
            x0 = torch.zeros(*lead, s.horizon, s.action_dim, device=feature.hidden.device)
        else:
            x0 = draws["x0"].float()

        def velocity(x, t):
            return self.velocity(feature, state, x, t)

        out = {}
        if "std" in draws:  # exploring: the SDE's chain and what the update scores
            chain = sample_chain(velocity, x0, self.steps, draws["std"], draws["z"])
            steps = draws["steps"].long()
            out = {"chain": chain, "chain_steps": steps, "chain_std": draws["std"].gather(-1, steps),
                   "step_log_prob": drawn_log_prob(draws["z"], draws["std"])}
            x = chain[..., -1, :, :]
        else:
            x = sample_chain(velocity, x0, self.steps, keep=False)
        out["actions"] = x
        if self.has_value:
            out["value"] = self.critic(feature, state)
        return out

    def evaluate(self, feature, state, actions, action_mask, sampled=None):
        """RL: the log-probability [..., B] of the chain a rollout sampled (`sampled`: its chain,
        chain_steps and chain_std) under the current weights, over the masked action steps; the
        entropy of its steps' Gaussians (fixed by the noise level) and the critic's value."""
        if not sampled or "chain" not in sampled:
            raise InvalidInputError("head kind 'flow': RL scores the denoising chain its rollout sampled; sample "
                                    "with exploration (an RL job's rl.flow) and train on that sample's chain")
        log_prob, entropy = chain_log_prob(lambda x, t: self.velocity(feature, state, x, t), sampled["chain"],
                                           sampled["chain_steps"], sampled["chain_std"])
        m = action_mask.to(log_prob.dtype)
        value = self.critic(feature, state) if self.has_value else None
        return (log_prob * m).sum(-1), (entropy * m).sum(-1), value
