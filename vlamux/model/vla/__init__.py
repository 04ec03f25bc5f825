"""Pretrained VLA policies (LeRobot's SmolVLA, π0, π0.5) split the way vlamux shares them: the VLM, a
shared backbone, computes the prefix's per-layer keys and values once; each tenant's action expert
reads them at every flow step. docs/LEROBOT_IMPORT.md holds what each step must reproduce."""

from vlamux.model.vla.checkpoint import FAMILIES, LeRobotCheckpoint
from vlamux.model.vla.policy import VLAPolicy

__all__ = ["FAMILIES", "LeRobotCheckpoint", "VLAPolicy"]
