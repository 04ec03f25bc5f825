"""The model core: a shared frozen backbone, tenant slots, and the group runner."""

from vlamux.model.backbones import Backbone, BackboneSpec, build_backbone, load_backbone, save_backbone
from vlamux.model.batch import CanonicalBatch, InputSchema, Observation, canonicalize
from vlamux.model.feature import FeatureMeta, TokenType, VLAFeature
from vlamux.model.group import ForwardBackward, Result, Sample, plan_groups
from vlamux.model.heads import HEADS, ActionHead, HeadSpec, build_head
from vlamux.model.normalize import NormStats
from vlamux.model.policy_loss import PolicyLoss, policy_objective
from vlamux.model.runner import ModelRunner
from vlamux.model.slot import OptimizerSpec, Slot

__all__ = [
    "ActionHead", "Backbone", "BackboneSpec", "CanonicalBatch", "FeatureMeta", "ForwardBackward", "HEADS",
    "HeadSpec", "InputSchema", "ModelRunner", "NormStats", "Observation", "OptimizerSpec", "PolicyLoss", "Result", "Sample",
    "Slot", "TokenType", "VLAFeature", "build_backbone", "build_head", "canonicalize", "load_backbone",
    "plan_groups", "policy_objective", "save_backbone",
]
