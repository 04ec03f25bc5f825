"""A diagonal Gaussian over the action chunk, with a value head: the policy PPO/GRPO train."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from vlamux.model.heads.base import ActionHead, masked_mean
from vlamux.model.heads.layers import Linear, broadcast_param
from vlamux.specs import Bound

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class GaussianHead(ActionHead):
    kind = "gaussian"
    DEFAULT_OPTIONS = {"init_log_std": -0.5}
    OPTION_BOUNDS = {"init_log_std": Bound(-1e6, 1e6)}  # finite (any value the API took before holds)
    INIT_OPTIONS = ("init_log_std",)
    HAS_VALUE = True

    def __init__(self, spec, feature_dim):
        super().__init__(spec, feature_dim)
        self.mean_out = Linear(spec.width, spec.action_dim)
        self.log_std = nn.Parameter(torch.full((spec.horizon, spec.action_dim), float(self.options["init_log_std"])))

    def distribution(self, feature, state) -> tuple[Tensor, Tensor, Tensor]:
        """mean [..., B, H, A], log_std [..., B, H, A], value [..., B]."""
        steps, pooled = self.decode(self.step_tokens(feature), feature, state)
        mean = self.mean_out(steps).float()  # log-probs and ratios in full precision under autocast
        log_std = broadcast_param(self.log_std.clamp(LOG_STD_MIN, LOG_STD_MAX), 2, mean).expand_as(mean)
        return mean, log_std, self.value(pooled)

    @staticmethod
    def step_log_prob(mean: Tensor, log_std: Tensor, actions: Tensor) -> Tensor:
        """Log-density of each step of the chunk [..., B, H], summed over the action dims."""
        z = (actions - mean) / log_std.exp()
        return (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    @classmethod
    def log_prob(cls, mean: Tensor, log_std: Tensor, actions: Tensor, action_mask: Tensor) -> Tensor:
        """Log-density of the whole chunk per row [..., B], summed over valid steps and all dims."""
        per_step = cls.step_log_prob(mean, log_std, actions)
        return (per_step * action_mask.to(per_step.dtype)).sum(-1)

    @staticmethod
    def entropy(log_std: Tensor, action_mask: Tensor) -> Tensor:
        per_dim = 0.5 + 0.5 * math.log(2 * math.pi) + log_std
        return (per_dim.sum(-1) * action_mask.to(per_dim.dtype)).sum(-1)

    def draw(self, purpose, batch, generator, deterministic=False):
        if purpose != "sample" or deterministic:
            return {}
        s = self.spec
        return {"eps": torch.randn(batch, s.horizon, s.action_dim, generator=generator)}

    def loss(self, feature, state, actions, action_mask, generator=None, noise=None):
        mean, log_std, _ = self.distribution(feature, state)
        z = (actions - mean) / log_std.exp()
        nll = masked_mean(0.5 * z.pow(2) + log_std + 0.5 * math.log(2 * math.pi), action_mask)
        return nll, {"nll": nll.detach(), "mse": masked_mean((mean - actions).pow(2), action_mask).detach()}

    def sample(self, feature, state, generator=None, deterministic=False, noise=None):
        mean, log_std, value = self.distribution(feature, state)
        if deterministic:
            actions = mean
        else:
            eps = self._noise("sample", feature, generator, noise)["eps"]
            actions = mean + eps.to(mean.dtype) * log_std.exp()
        steps = self.step_log_prob(mean, log_std, actions)
        return {"actions": actions, "log_prob": steps.sum(-1), "step_log_prob": steps, "value": value}

    def evaluate(self, feature, state, actions, action_mask, sampled=None):
        mean, log_std, value = self.distribution(feature, state)
        return self.log_prob(mean, log_std, actions, action_mask), self.entropy(log_std, action_mask), value
