"""Requests to a model runner, their results, and the grouping decision.

`plan_groups` decides which requests share one backbone forward; it touches
no tensors. Requests share a group when they use the same backbone; a group
holds at most `max_rows` rows. Every split is logged at debug level with its
reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import Tensor

from vlamux.model.batch import Observation
from vlamux.model.heads.flow_sde import FlowExploration
from vlamux.model.policy_loss import PolicyLoss

log = logging.getLogger(__name__)


@dataclass
class ForwardBackward:
    """Accumulate the gradients of the tenant's loss on (obs, actions): supervised, or RL with `loss`."""

    tenant: str
    obs: Observation
    actions: Tensor  # [B, H, A] in the tenant's units
    action_mask: Tensor | None = None  # [B, H] bool, False on padded (or, for RL, unexecuted) steps
    loss: PolicyLoss | None = None  # None: the head's supervised loss; else the RL objective
    # a flow head's draws, given instead of drawn (to reproduce a reference): noise [B, H, A'], time [B]
    noise: Tensor | None = None
    time: Tensor | None = None


@dataclass
class Sample:
    """Sample an action chunk for each observation."""

    tenant: str
    obs: Observation
    deterministic: bool = False
    noise: Tensor | None = None  # a flow head's starting noise [B, H, A'], given instead of drawn
    # a flow policy sampling for RL: its chain stochastic (its noise drawn, with a given start too), kept
    explore: FlowExploration | None = None


Request = ForwardBackward | Sample


def given_draws(req: Request) -> dict | None:
    """A request's draws as its caller gave them (a flow head's noise, and for a loss its time), in the
    heads' draw layout; None: the tenant's generator draws them."""
    if req.noise is None:
        return None
    if isinstance(req, Sample):
        return {"x0": req.noise}
    if req.time is None:
        raise ValueError("ForwardBackward: noise is given, time is not (a flow loss takes both)")
    return {"noise": req.noise, "t": req.time}


@dataclass
class Result:
    tenant: str
    output: dict | None = None
    error: Exception | None = None
    backbone_s: float = 0.0  # this request's share of its group's backbone time (by rows), plus its preprocessing
    head_s: float = 0.0  # time in the tenant's own head, in full
    group_size: int = 1  # requests that shared the backbone forward
    timings: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> dict:
        if self.error is not None:
            raise self.error
        return self.output


def plan_groups(keys: list[str], rows: list[int], max_rows: int | dict | None = None,
                tenants: list[str] | None = None, adapters: list[str | None] | None = None,
                max_adapters: int | None = None) -> list[list[int]]:
    """Partition request indices into groups of equal key, at most `max_rows` rows (one number, or one
    per key: a backbone's learned cap) and at most `max_adapters` distinct adapters (`adapters`: each
    request's adapter, None for none; each adapter in a group is one more segment of every adapted
    Linear, as S-LoRA's and SGLang's per-batch caps count them), keeping order."""
    groups: list[list[int]] = []
    open_group: dict[str, int] = {}  # key -> index in groups of the group still taking requests
    sizes: list[int] = []
    held: list[set] = []  # each group's distinct adapters
    for i, (key, n) in enumerate(zip(keys, rows)):
        who = f"request {i}" + (f" (tenant {tenants[i]!r})" if tenants else "")
        g = open_group.get(key)
        cap = max_rows.get(key) if isinstance(max_rows, dict) else max_rows
        adapter = adapters[i] if adapters else None
        if g is not None and cap is not None and sizes[g] + n > cap:
            log.debug("%s starts a new group: group %d is full (%d + %d rows > max %d)", who, g, sizes[g], n, cap)
            g = None
        elif g is not None and max_adapters is not None and adapter is not None and adapter not in held[g] \
                and len(held[g]) >= max_adapters:
            log.debug("%s starts a new group: group %d holds %d adapters (max %d)", who, g, len(held[g]), max_adapters)
            g = None
        if g is None:
            if open_group and key not in open_group:
                log.debug("%s cannot share a backbone call with groups of %s: it needs backbone %r", who,
                          sorted(open_group), key)
            g = len(groups)
            groups.append([])
            sizes.append(0)
            held.append(set())
            open_group[key] = g
        groups[g].append(i)
        sizes[g] += n
        if adapter is not None:
            held[g].add(adapter)
    return groups
