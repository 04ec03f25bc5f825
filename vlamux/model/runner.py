"""The model runner: the one place that touches backbone and head tensors.

`execute(requests)` canonicalises each tenant's request, runs one backbone
forward per group, splits the features back per request and runs each
tenant's head in its own slot. One tenant's failure (bad input, exception,
NaN) fails that tenant's result only.
"""

from __future__ import annotations

import logging
import time

import torch

from vlamux.errors import InvalidInputError, UnknownTenantError
from vlamux.model.backbones import Backbone
from vlamux.model.batch import CanonicalBatch, canonicalize
from vlamux.model.feature import VLAFeature
from vlamux.model.group import ForwardBackward, Request, Result, Sample, plan_groups
from vlamux.model.heads import HeadSpec
from vlamux.model.slot import OptimizerSpec, Slot

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, backbones: Backbone | list[Backbone], max_group_rows: int | None = None):
        backbones = [backbones] if isinstance(backbones, Backbone) else list(backbones)
        if not backbones:
            raise ValueError("a model runner needs at least one backbone")
        self.backbones = {b.backbone_id: b for b in backbones}
        self.default_backbone = backbones[0].backbone_id
        self.max_group_rows = max_group_rows
        self.slots: dict[str, Slot] = {}

    # ---- slots ----------------------------------------------------------------------------------
    def create_slot(self, tenant: str, head_spec: HeadSpec, optim: OptimizerSpec | None = None, seed: int = 0,
                    backbone_id: str | None = None) -> Slot:
        backbone = self._backbone(backbone_id or self.default_backbone)
        return self.add_slot(Slot(tenant, head_spec, backbone.meta, optim, seed, backbone.device))

    def add_slot(self, slot: Slot) -> Slot:
        if slot.tenant in self.slots:
            raise ValueError(f"tenant {slot.tenant!r} already has a slot")
        depth = self._backbone(slot.backbone_id).meta.n_layers
        if slot.head_spec.feature_layers > depth:
            raise ValueError(f"head spec: feature_layers={slot.head_spec.feature_layers} but backbone "
                             f"{slot.backbone_id!r} has {depth} layers")
        self.slots[slot.tenant] = slot
        return slot

    def remove_slot(self, tenant: str) -> Slot:
        return self.slots.pop(self.slot(tenant).tenant)

    def slot(self, tenant: str) -> Slot:
        try:
            return self.slots[tenant]
        except KeyError:
            raise UnknownTenantError(f"no slot for tenant {tenant!r}") from None

    def _backbone(self, backbone_id: str) -> Backbone:
        try:
            return self.backbones[backbone_id]
        except KeyError:
            raise ValueError(f"unknown backbone {backbone_id!r}; this runner has {sorted(self.backbones)}") from None

    # ---- execution ------------------------------------------------------------------------------
    def optim_step(self, tenant: str) -> Result:
        t0 = time.perf_counter()
        try:
            out = self.slot(tenant).optim_step()
            return Result(tenant, out, head_s=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - one tenant's failure is that tenant's result
            return Result(tenant, error=e, head_s=time.perf_counter() - t0)

    def execute(self, requests: list[Request], grouped: bool = True) -> list[Result]:
        """Run `requests`; results come back in the same order. `grouped=False` runs them one by one."""
        results = [Result(getattr(r, "tenant", "?")) for r in requests]
        batches: dict[int, CanonicalBatch] = {}
        for i, req in enumerate(requests):
            t0 = time.perf_counter()
            try:
                if not isinstance(req, (ForwardBackward, Sample)):
                    raise InvalidInputError(f"request {i}: expected ForwardBackward or Sample, got {type(req).__name__}")
                slot = self.slot(req.tenant)
                backbone = self.backbones[slot.backbone_id]
                batches[i] = canonicalize(req.obs, backbone.schema, backbone.tokenizer, backbone.device,
                                          backbone.dtype)
            except Exception as e:  # noqa: BLE001
                results[i].error = e
            results[i].backbone_s = time.perf_counter() - t0

        valid = sorted(batches)
        if grouped:
            keys = [self.slots[requests[i].tenant].backbone_id for i in valid]
            rows = [batches[i].batch_size for i in valid]
            plan = [[valid[j] for j in g] for g in plan_groups(keys, rows, self.max_group_rows,
                                                               [requests[i].tenant for i in valid])]
        else:
            plan = [[i] for i in valid]
        for group in plan:
            self._run_group(group, requests, batches, results)
        return results

    def _run_group(self, group: list[int], requests: list[Request], batches: dict[int, CanonicalBatch],
                   results: list[Result]) -> None:
        slots = [self.slots[requests[i].tenant] for i in group]
        backbone = self.backbones[slots[0].backbone_id]
        n_layers = max(s.head_spec.feature_layers for s in slots)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                features = backbone.forward_group([batches[i] for i in group], n_layers=n_layers)
            _sync(backbone.device)
        except Exception as e:  # noqa: BLE001
            if len(group) > 1:
                # Find the request that broke the group; the others must still succeed.
                log.warning("group of %d requests failed in the backbone (%s); retrying one by one", len(group), e)
                for i in group:
                    self._run_group([i], requests, batches, results)
                return
            results[group[0]].error = e
            return
        backbone_s = time.perf_counter() - t0

        total_rows = sum(batches[i].batch_size for i in group)
        for i, slot, feature in zip(group, slots, features):
            res = results[i]
            res.group_size = len(group)
            res.backbone_s += backbone_s * batches[i].batch_size / total_rows
            t1 = time.perf_counter()
            try:
                mine = feature.select(slice(None), None, slot.head_spec.feature_layers)
                res.output = self._run_head(requests[i], slot, mine)
            except Exception as e:  # noqa: BLE001 - one tenant's failure is that tenant's result
                log.debug("tenant %r request failed: %s", slot.tenant, e)
                res.error = e
            _sync(backbone.device)
            res.head_s = time.perf_counter() - t1

    @staticmethod
    def _run_head(req: Request, slot: Slot, feature: VLAFeature) -> dict:
        if isinstance(req, ForwardBackward):
            return slot.forward_backward(feature, req.obs.state, req.actions, req.action_mask, req.loss)
        return slot.sample(feature, req.obs.state, req.deterministic)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
