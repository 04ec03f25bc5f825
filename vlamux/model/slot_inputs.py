"""What a slot's operations take and give back, between the runner and the slot: a request's row
inputs, a forward_backward's checked inputs, and its gradients before the group's finiteness check."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vlamux.errors import InvalidInputError
from vlamux.model.batch import check_float_tensor
from vlamux.model.device import to_device
from vlamux.model.feature import VLAFeature
from vlamux.model.policy_loss import PolicyLoss


@dataclass
class PendingGrads:
    """A forward_backward computed on the device but not applied yet. Whether it is finite is only
    known once the host reads `finite`, which the runner does for a whole group at once (one wait
    per group, not one per tenant); `Slot.settle` then applies or drops it."""

    grads: list  # per trainable parameter (Slot.params order): Tensor or None
    out: dict  # "loss", metrics and extras: device tensors, bound for the host
    finite: Tensor  # 0-d bool: the loss and every gradient are finite
    rng: Tensor  # the generator's state before this call's draws (restored if it is dropped)
    norm: Tensor | None = None  # 0-d: the gradients' global L2 norm (None: no gradient)


@dataclass
class RowInputs:
    """A request's per-row inputs to one tenant's head, checked (`Slot.check_rows`), in its own units."""

    state: Tensor | None
    actions: Tensor | None = None
    mask: Tensor | None = None
    loss: PolicyLoss | None = None

    def to(self, device) -> RowInputs:
        move = (lambda t: None if t is None else to_device(t, device))
        return RowInputs(move(self.state), move(self.actions), move(self.mask),
                         None if self.loss is None else self.loss.to(device))


@dataclass
class FBInputs:
    """One tenant's forward_backward inputs, checked, normalised and on the slot's device."""

    feature: VLAFeature
    state: Tensor | None
    actions: Tensor
    mask: Tensor
    loss: PolicyLoss | None


def check_rows(tenant: str, head_spec, head, batch: int, state: Tensor | None, actions: Tensor | None = None,
               action_mask: Tensor | None = None, loss: PolicyLoss | None = None, train: bool = False) -> RowInputs:
    """`Slot.check_rows`: a request's per-row inputs for `tenant`'s head, checked on the host."""
    s = head_spec.state_dim
    if s == 0:
        state = None  # this head reads no proprio state; ignore what the observation carries
    elif state is None:
        raise InvalidInputError(f"state: the head of tenant {tenant!r} needs a proprio state [B, {s}]")
    else:
        check_float_tensor("state", state, (batch, s))
    if not train:
        return RowInputs(state)
    h, a = head_spec.horizon, head_spec.action_dim
    check_float_tensor("actions", actions, (batch, h, a))
    if action_mask is None:
        action_mask = torch.ones(batch, h, dtype=torch.bool)
    elif not isinstance(action_mask, Tensor) or action_mask.dtype != torch.bool \
            or tuple(action_mask.shape) != (batch, h):
        got = f"{action_mask.dtype} {list(action_mask.shape)}" if isinstance(action_mask, Tensor) \
            else type(action_mask).__name__
        raise InvalidInputError(f"action_mask: expected a bool tensor [{batch}, {h}], got {got}")
    if not action_mask.any():
        raise InvalidInputError("action_mask: no valid step in the batch")
    if loss is not None:
        loss.check(batch)
        if loss.sampled is not None:
            _check_chain(tenant, head_spec, head, loss.sampled["chain"])
    return RowInputs(state, actions, action_mask, loss)


def _check_chain(tenant: str, head_spec, head, chain: Tensor) -> None:
    if not getattr(head, "EXPLORES", False):
        raise InvalidInputError(f"loss.sampled: the {head_spec.kind} head of tenant {tenant!r} scores its actions "
                                f"alone; a denoising chain is for a flow head")
    want = head.chain_shape()
    if tuple(chain.shape[1:]) != want:
        raise InvalidInputError(f"loss.sampled.chain: tenant {tenant!r}'s head samples chains of "
                                f"[B, {', '.join(map(str, want))}] (steps + 1, horizon, action dims), got "
                                f"{list(chain.shape)}")
