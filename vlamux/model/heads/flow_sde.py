"""Flow-SDE: a flow-matching sampler made stochastic, with the exact log-probability of what it drew
(Flow-GRPO; πRL's Flow-SDE), so that PPO and GRPO can train a flow policy.

Convention (the built-in flow head's; an imported expert's is mapped onto it): x_t = (1 - t) * noise +
t * actions, the velocity v = actions - noise, sampling from t = 0 to 1 in K Euler steps t_k = k / K.
The noise a state holds is predicted as eps = x - t * v, so the marginal's score is -eps / (1 - t), and

    dx = [v - sigma_t^2 / 2 * (x - t v) / (1 - t)] dt + sigma_t dW

has the ODE's marginals for any sigma_t. Each Euler-Maruyama step is then a Gaussian,

    x_{k+1} ~ N(mean_k, std_k^2),   mean_k = x_k + v dt - std_k^2 (x_k - t_k v) / (2 (1 - t_k)),

with std_k = sigma_{t_k} sqrt(dt); std_k = 0 is the plain Euler step of the ODE. sigma_t =
noise_level * sqrt((1 - t) / t) (large near the noise, none at the actions), with t = dt in place of
t = 0 where it is infinite, as Flow-GRPO does. Only `steps_trained` of the K steps, drawn per row, are
made stochastic (the others stay ODE steps): the log-probability of a chain is the sum over its
stochastic steps, and evaluating it costs one velocity per such step.

A rollout keeps the chain x_0..x_K and each step's std; the update recomputes each stochastic step's
mean under the current weights from the stored x_k (the denoising chain as a Markov decision process)
and scores the stored x_{k+1}. Everything works over any leading dimensions (one tenant's [B, ...] or
a fused call's [N, B, ...]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from vlamux.specs import bounded, check

# what a flow rollout keeps for its update, per row: the chain x_0..x_K [B, K+1, H, A], its stochastic
# steps' indices [B, m] and their stds [B, m]
RL_SAMPLED = ("chain", "chain_steps", "chain_std")
NOISE_LEVEL_MAX = 2.0  # sigma_t / sqrt((1 - t) / t); Flow-GRPO uses 0.7, πRL 0.3-0.7
LOG_2PI = math.log(2 * math.pi)

Velocity = Callable[[Tensor, Tensor], Tensor]  # (x [..., B, H, A], t [..., B]) -> v [..., B, H, A]


@dataclass(frozen=True)
class FlowExploration:
    """How a flow policy samples for RL (a job's `rl.flow`): the noise level of its SDE and how many of
    its denoising steps are stochastic, drawn per row (each one's log-probability is trained, one
    velocity each in the update; 0: all of them)."""

    noise_level: float = bounded(0.5, 0.0, NOISE_LEVEL_MAX)
    steps_trained: int = bounded(0, 0, 4096)
    # how the chain is made stochastic: "sde" (the ODE's marginal-preserving SDE). πRL's other way,
    # Flow-Noise (a learned noise network), is not built: a spec asking for it is refused by name
    mode: str = bounded("sde", choices=("sde",))

    def __post_init__(self):
        check(self)  # a SpecError (an InvalidInputError) naming the field


def draw_steps(explore: FlowExploration, batch: int, steps: int, shape: tuple, generator) -> dict[str, Tensor]:
    """The host draws of a stochastic chain for `batch` rows, from `generator`: `z` [B, K, *shape] (each
    step's noise), `std` [B, K] (each step's std; 0 for the steps left deterministic) and `steps` [B, m]
    (the stochastic steps' indices, ascending; m = steps_trained, or K)."""
    z = torch.randn(batch, steps, *shape, generator=generator)
    m = steps if explore.steps_trained in (0, None) else min(explore.steps_trained, steps)
    if m < steps:  # which steps are stochastic: m of the K, per row, uniformly
        chosen = torch.rand(batch, steps, generator=generator).argsort(dim=1)[:, :m].sort(dim=1).values
    else:
        chosen = torch.arange(steps).expand(batch, -1).clone()
    on = torch.zeros(batch, steps, dtype=torch.bool).scatter_(1, chosen, True)
    return {"z": z, "std": step_stds(explore.noise_level, steps).expand(batch, -1) * on, "steps": chosen}


def step_stds(noise_level: float, steps: int) -> Tensor:
    """std_k = sigma_{t_k} sqrt(dt) for k = 0..K-1 [K] (float32)."""
    dt = 1.0 / steps
    t = torch.arange(steps, dtype=torch.float64) * dt
    t_eff = t.clamp(min=dt)  # sigma is infinite at t = 0: the next step's value there
    return (noise_level * torch.sqrt((1 - t_eff) / t_eff) * math.sqrt(dt)).float()


def step_mean(x: Tensor, v: Tensor, t: Tensor, dt: float, std: Tensor) -> Tensor:
    """The mean of the Euler-Maruyama step from x [..., B, H, A] at time t [..., B] (std: this step's
    [..., B]; 0 is the ODE's Euler step)."""
    t = t[..., None, None]
    var = std.pow(2)[..., None, None]
    return x + v * dt - var * (x - t * v) / (2 * (1 - t))


def sample_chain(velocity: Velocity, x0: Tensor, steps: int, std: Tensor | None = None, z: Tensor | None = None,
                 keep: bool = True) -> Tensor:
    """The chain x_0..x_K [..., B, K+1, H, A] from x0 [..., B, H, A] (float32): ODE steps where std is
    None or 0, else each step x_{k+1} = mean_k + std_k z_k (std [..., B, K], z [..., B, K, H, A]).
    keep=False: x_K alone (the plain sampler, which keeps no chain)."""
    dt = 1.0 / steps
    x = x0.float()
    chain = [x]
    for k in range(steps):
        t = torch.full(x.shape[:-2], k * dt, device=x.device)
        v = velocity(x, t).float()
        if std is None:
            x = x + dt * v
        else:
            s = std[..., k].to(x.device, torch.float32)
            x = step_mean(x, v, t, dt, s) + s[..., None, None] * z[..., k, :, :].to(x.device, torch.float32)
        if keep:
            chain.append(x)
    return torch.stack(chain, dim=-3) if keep else x


def drawn_log_prob(z: Tensor, std: Tensor, dims: int | None = None) -> Tensor:
    """The log-probability [..., B, H] of the steps a chain drew (std > 0) from their draws alone:
    x_{k+1} - mean_k = std_k z_k, so each is a standard normal's density of z_k less log std_k."""
    on = std > 0
    safe = torch.where(on, std, torch.ones_like(std)).float()[..., None, None]  # [..., B, K, 1, 1]
    per = -0.5 * z.float().pow(2) - safe.log() - 0.5 * LOG_2PI  # [..., B, K, H, A]
    if dims is not None:
        per = per[..., :dims]
    return (per.sum(-1) * on.to(per.dtype)[..., None]).sum(-2)


def chain_log_prob(velocity: Velocity, chain: Tensor, steps: Tensor, std: Tensor, dims: int | None = None
                   ) -> tuple[Tensor, Tensor]:
    """(log-probability, entropy), each [..., B, H] (per action step of the chunk), of the stored
    `chain` [..., B, K+1, H, A]'s stochastic steps `steps` [..., B, m] (their std [..., B, m]) under
    `velocity` (the current weights: differentiable), summed over those steps and the first `dims`
    action dims (None: all). One velocity per stochastic step of a row, m in all."""
    n_steps = chain.shape[-3] - 1
    dt = 1.0 / n_steps
    log_prob = entropy = None
    for j in range(steps.shape[-1]):
        k = steps[..., j].long()  # [..., B]
        at = k[..., None, None, None].expand(*k.shape, 1, *chain.shape[-2:])
        x = chain.gather(-3, at).squeeze(-3)
        nxt = chain.gather(-3, at + 1).squeeze(-3)
        t = k.to(torch.float32) * dt
        s = std[..., j].float()
        mean = step_mean(x.float(), velocity(x, t).float(), t, dt, s)
        sd = s[..., None, None]
        per = -0.5 * ((nxt.float() - mean) / sd).pow(2) - sd.log() - 0.5 * LOG_2PI
        ent = (0.5 + 0.5 * LOG_2PI + sd.log()).expand_as(per)
        if dims is not None:
            per, ent = per[..., :dims], ent[..., :dims]
        log_prob = per.sum(-1) if log_prob is None else log_prob + per.sum(-1)
        entropy = ent.sum(-1) if entropy is None else entropy + ent.sum(-1)
    return log_prob, entropy
