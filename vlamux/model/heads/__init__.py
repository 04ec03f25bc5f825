"""Tenant action heads. `build_head(spec, feature_dim)` makes one from its spec."""

from __future__ import annotations

from vlamux.model.heads.base import HEADS, IMPORTED_HEADS, ActionHead, HeadSpec
from vlamux.model.heads.bins import BinsHead
from vlamux.model.heads.flow import FlowHead
from vlamux.model.heads.gaussian import GaussianHead
from vlamux.model.heads.l1_chunk import L1ChunkHead
from vlamux.model.heads.layers import init_linear
from vlamux.model.heads.lerobot import LeRobotHead

HEADS.update({h.kind: h for h in (L1ChunkHead, FlowHead, GaussianHead, BinsHead)})
IMPORTED_HEADS.update({LeRobotHead.kind: LeRobotHead})

__all__ = ["ActionHead", "HeadSpec", "HEADS", "build_head"]


def build_head(spec: HeadSpec, feature_dim: int, init: bool = True) -> ActionHead:
    """A head for `spec`; init=False leaves its Linears as built (a state is loaded next)."""
    if spec.kind in IMPORTED_HEADS:  # its weights are loaded next: no initialisation of ours
        return IMPORTED_HEADS[spec.kind](spec, feature_dim)
    if spec.kind not in HEADS:
        raise ValueError(f"head spec: unknown kind {spec.kind!r}; choose one of {sorted(HEADS)}")
    head = HEADS[spec.kind](spec, feature_dim)
    if init:
        init_linear(head)
    return head
