"""The flow-matching policy's two computations, on a prefix computed once: sampling (Euler steps from
noise at t = 1 to actions at t = 0, every step reusing the prefix's keys and values) and the training
loss (the velocity's squared error at a noisy point between the actions and the noise)."""

from __future__ import annotations

import torch
from torch import Tensor

from vlamux.model.vla.experts import Expert
from vlamux.model.vla.vlm import PrefixKV


def sample(expert: Expert, kv: PrefixKV, noise: Tensor, state: Tensor | None, steps: int = 10) -> Tensor:
    """Normalised, padded actions [B, T, A] from `noise` [B, T, A]: `steps` Euler steps, t = 1, 1 + dt, ...
    (dt = -1/steps, the time as lerobot forms it: a Python float, then fp32)."""
    dt = -1.0 / steps
    x = noise
    for k in range(steps):
        t = torch.full((x.shape[0],), 1.0 + k * dt, dtype=torch.float32, device=x.device)
        x = x + dt * expert.velocity(kv, x, t, state)
    return x


def loss(expert: Expert, kv: PrefixKV, actions: Tensor, noise: Tensor, t: Tensor, state: Tensor | None,
         dims: int | None = None) -> Tensor:
    """Mean of (u_t - v_t)² over [B, T, dims] (all of the padded dims where `dims` is None), where
    x_t = t·noise + (1-t)·actions and u_t = noise - actions; `actions` normalised and padded."""
    tt = t.to(actions.dtype)[:, None, None]
    x_t = tt * noise + (1.0 - tt) * actions
    err = (noise - actions - expert.velocity(kv, x_t, t, state)) ** 2
    return (err if dims is None else err[..., :dims]).mean()
