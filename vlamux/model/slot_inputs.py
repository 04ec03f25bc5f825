"""What a slot's operations take and give back, between the runner and the slot: a request's row
inputs, a forward_backward's checked inputs, and its gradients before the group's finiteness check."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

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
