"""Tenant action heads. `build_head(spec, feature_dim)` makes one from its spec."""

from __future__ import annotations

from vlamux.model.heads.base import ActionHead, HeadSpec
from vlamux.model.heads.bins import BinsHead
from vlamux.model.heads.flow import FlowHead
from vlamux.model.heads.gaussian import GaussianHead
from vlamux.model.heads.l1_chunk import L1ChunkHead
from vlamux.model.heads.layers import init_linear

HEADS: dict[str, type[ActionHead]] = {h.kind: h for h in (L1ChunkHead, FlowHead, GaussianHead, BinsHead)}

__all__ = ["ActionHead", "HeadSpec", "HEADS", "build_head"]


def build_head(spec: HeadSpec, feature_dim: int) -> ActionHead:
    if spec.kind not in HEADS:
        raise ValueError(f"head spec: unknown kind {spec.kind!r}; choose one of {sorted(HEADS)}")
    head = HEADS[spec.kind](spec, feature_dim)
    init_linear(head)
    return head
