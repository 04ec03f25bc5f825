"""Advantage estimators: GAE for PPO, group-normalised returns for GRPO."""

from __future__ import annotations

import torch


def gae(reward: torch.Tensor, value: torch.Tensor, done: torch.Tensor, last_value: torch.Tensor,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """reward, value, done: [T, n]; last_value [n] bootstraps the step after the segment.
    Returns (advantages, returns), both [T, n]. An episode's end (done) cuts the bootstrap."""
    steps = reward.shape[0]
    adv = torch.zeros_like(reward)
    running = torch.zeros_like(last_value)
    next_value = last_value
    for t in reversed(range(steps)):
        alive = (~done[t]).to(reward.dtype)
        delta = reward[t] + gamma * next_value * alive - value[t]
        running = delta + gamma * lam * alive * running
        adv[t] = running
        next_value = value[t]
    return adv, adv + value


def group_advantages(returns: torch.Tensor, group: torch.Tensor, eps: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: per-env episode returns [n] normalised within their group (envs reset to the same
    state). Returns (advantages [n], keep [n]); groups whose returns all agree carry no signal and
    are dropped (keep False)."""
    adv = torch.zeros_like(returns)
    keep = torch.zeros(returns.shape, dtype=torch.bool)
    for g in torch.unique(group):
        m = group == g
        r = returns[m]
        std = r.std(unbiased=False)
        if std > eps:
            adv[m] = (r - r.mean()) / (std + eps)
            keep[m] = True
    return adv, keep
