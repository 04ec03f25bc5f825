"""The reinforcement-learning objective a tenant's head is trained with: decoupled PPO.

Asynchronous RL trains on data that an older policy version produced. Decoupled PPO (Hilton et al.,
"Batch size-invariance for policy optimization") splits the two roles of PPO's old policy: the
*behaviour* policy that acted (its log-probs are stored per step) only reweights the sample, with a
truncated importance weight pi_prox / pi_behav, while the clipping trust region is taken around a
recent *proximal* policy (by default the current weights, detached). With fresh data the weight is 1
and this is PPO; with stale data the correction is explicit and bounded.

GRPO uses the same objective with group-normalised advantages and no value target.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from vlamux.errors import InvalidInputError
from vlamux.model.batch import check_float_tensor
from vlamux.model.device import to_device
from vlamux.model.heads.flow_sde import RL_SAMPLED


@dataclass
class PolicyLoss:
    """Per-row RL inputs of one forward_backward (rows = action chunks)."""

    behaviour_log_prob: Tensor  # [B] log-prob of the executed steps under the policy that acted
    advantages: Tensor  # [B]
    returns: Tensor | None = None  # [B] value targets (PPO); None: no value loss (GRPO)
    proximal_log_prob: Tensor | None = None  # [B]; None: the current policy's, detached
    clip_eps: float = 0.2
    max_is_weight: float = 2.0  # truncation of pi_prox / pi_behav (variance bound)
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    # what the rollout's sample kept for the update besides the actions, per row ([B, ...]): a flow
    # policy's denoising chain (RL_SAMPLED); None for heads that score the actions alone
    sampled: dict[str, Tensor] | None = None

    def to(self, device) -> PolicyLoss:
        """The same objective with its tensors on `device` (the host checks them first: `check`)."""
        moved = {k: None if getattr(self, k) is None else to_device(getattr(self, k), device, torch.float32)
                 for k in ("behaviour_log_prob", "advantages", "returns", "proximal_log_prob")}
        if self.sampled is not None:
            moved["sampled"] = {k: to_device(v, device) for k, v in self.sampled.items()}
        return dataclasses.replace(self, **moved)

    def check(self, batch: int) -> None:
        for name in ("behaviour_log_prob", "advantages", "returns", "proximal_log_prob"):
            v = getattr(self, name)
            if v is not None or name in ("behaviour_log_prob", "advantages"):
                check_float_tensor(f"loss.{name}", v, (batch,))
        for name in ("clip_eps", "max_is_weight"):
            if not getattr(self, name) > 0:
                raise InvalidInputError(f"loss.{name}: must be > 0, got {getattr(self, name)}")
        if self.sampled is not None:
            check_chain(self.sampled, batch)


def check_chain(sampled, batch: int) -> None:
    """A flow rollout's kept sample (RL_SAMPLED), checked on the host before any of it reaches a device:
    its step indices index the chain (a gather out of range would fault a GPU), its stds are positive."""
    if not isinstance(sampled, dict) or set(sampled) != set(RL_SAMPLED):
        got = sorted(sampled) if isinstance(sampled, dict) else type(sampled).__name__
        raise InvalidInputError(f"loss.sampled: expected the tensors {list(RL_SAMPLED)}, got {got}")
    chain, steps, std = (sampled[k] for k in RL_SAMPLED)
    check_float_tensor("loss.sampled.chain", chain, (batch, None, None, None))
    if chain.shape[1] < 2:
        raise InvalidInputError(f"loss.sampled.chain: a chain of at least two states [B, K+1, H, A], got "
                                f"{list(chain.shape)}")
    if not isinstance(steps, Tensor) or steps.dtype not in (torch.int32, torch.int64) or steps.dim() != 2 \
            or steps.shape[0] != batch:
        raise InvalidInputError(f"loss.sampled.chain_steps: expected an integer tensor [{batch}, m], got "
                                f"{getattr(steps, 'dtype', type(steps).__name__)} {list(getattr(steps, 'shape', []))}")
    if steps.numel() and (int(steps.min()) < 0 or int(steps.max()) >= chain.shape[1] - 1):
        raise InvalidInputError(f"loss.sampled.chain_steps: each must index a step of the chain, 0.."
                                f"{chain.shape[1] - 2}; got {int(steps.min())}..{int(steps.max())}")
    check_float_tensor("loss.sampled.chain_std", std, tuple(steps.shape))
    if steps.numel() and not bool((std > 0).all()):
        raise InvalidInputError("loss.sampled.chain_std: every stochastic step's std must be > 0 "
                                "(a noise level of 0 leaves nothing to score)")


def policy_objective(log_prob: Tensor, entropy: Tensor, value: Tensor | None, spec: PolicyLoss
                     ) -> tuple[Tensor, dict]:
    """The decoupled-PPO loss from the current policy's per-row log_prob, entropy and value."""
    dev = log_prob.device
    behaviour = to_device(spec.behaviour_log_prob, dev, torch.float32)
    adv = to_device(spec.advantages, dev, torch.float32)
    prox = log_prob.detach() if spec.proximal_log_prob is None else to_device(spec.proximal_log_prob, dev,
                                                                                torch.float32)
    is_weight = (prox - behaviour).exp().clamp(max=spec.max_is_weight)
    ratio = (log_prob - prox).exp()
    clipped = ratio.clamp(1 - spec.clip_eps, 1 + spec.clip_eps)
    policy = -(is_weight * torch.min(ratio * adv, clipped * adv)).mean()
    loss = policy - spec.entropy_coef * entropy.mean()
    # 0-d tensors: reading them waits for the device, which the caller does once per group
    metrics = {"policy_loss": policy.detach(), "entropy": entropy.mean().detach(),
               "is_weight": is_weight.mean().detach(),
               "clip_frac": ((ratio - 1).abs() > spec.clip_eps).float().mean().detach(),
               "approx_kl": (prox - log_prob).mean().detach()}
    if spec.returns is not None:
        if value is None:
            raise InvalidInputError("loss.returns: this head has no value output")
        v_loss = 0.5 * (value - to_device(spec.returns, dev, torch.float32)).pow(2).mean()
        loss = loss + spec.value_coef * v_loss
        metrics["value_loss"] = v_loss.detach()
    return loss, metrics
