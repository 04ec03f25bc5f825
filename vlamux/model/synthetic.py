"""Procedural reaching data: observations and expert action chunks, no simulator needed.

Used by the model-core demo, tests and benchmarks until the MuJoCo suite
exists. A scene has three coloured blocks on a table seen from above (and
optionally a wrist view around the gripper); the instruction names one block
and the expert chunk moves the gripper to it. It is learnable from the
images plus the instruction, and tenants can differ in cameras, image sizes,
action dimension, horizon and phrasing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlamux.model.batch import Observation

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}


@dataclass(frozen=True)
class TaskProfile:
    cameras: dict[str, tuple[int, int]] = field(default_factory=lambda: {"top": (64, 64)})  # name -> (H, W)
    action_dim: int = 4
    horizon: int = 8
    state_dim: int = 4
    template: str = "reach the {color} block"


def make_batch(profile: TaskProfile, batch: int, generator: torch.Generator) -> tuple[Observation, Tensor]:
    """(observations, expert actions [B, H, A])."""
    names = list(COLORS)
    images = {cam: torch.empty(batch, 3, h, w, dtype=torch.uint8) for cam, (h, w) in profile.cameras.items()}
    instructions, states, actions = [], [], []
    for row in range(batch):
        picks = torch.randperm(len(names), generator=generator)[:3].tolist()
        blocks = torch.rand(3, 2, generator=generator) * 1.6 - 0.8  # block centres in [-0.8, 0.8]^2
        target = int(torch.randint(3, (1,), generator=generator))
        grip = torch.rand(2, generator=generator) * 1.6 - 0.8
        for cam, img in images.items():
            zoom = 3.0 if cam != "top" else 1.0  # non-top cameras are wrist views centred on the gripper
            centre = grip if cam != "top" else torch.zeros(2)
            img[row] = _render(img.shape[2], img.shape[3], blocks, [names[p] for p in picks], grip, centre, zoom)
        instructions.append(profile.template.format(color=names[picks[target]]))
        delta = blocks[target] - grip
        steps = torch.arange(1, profile.horizon + 1, dtype=torch.float32)[:, None] / profile.horizon
        chunk = torch.zeros(profile.horizon, profile.action_dim)
        chunk[:, : min(2, profile.action_dim)] = (steps * delta)[:, : profile.action_dim]
        if profile.action_dim > 2:
            chunk[:, 2] = (steps[:, 0] > 0.75).float() * 2 - 1  # close the gripper at the end
        actions.append(chunk)
        state = torch.zeros(profile.state_dim)
        state[: min(2, profile.state_dim)] = grip[: profile.state_dim]
        states.append(state)
    obs = Observation(images=images, instruction=instructions,
                      state=torch.stack(states) if profile.state_dim else None)
    return obs, torch.stack(actions)


def _render(h: int, w: int, blocks: Tensor, colors: list[str], grip: Tensor, centre: Tensor, zoom: float) -> Tensor:
    ys = (torch.arange(h, dtype=torch.float32) + 0.5) / h * 2 - 1
    xs = (torch.arange(w, dtype=torch.float32) + 0.5) / w * 2 - 1
    yy, xx = torch.meshgrid(ys / zoom + centre[1], xs / zoom + centre[0], indexing="ij")
    img = torch.full((3, h, w), 110.0)
    for (bx, by), color in zip(blocks.tolist(), colors):
        inside = ((xx - bx).abs() < 0.12) & ((yy - by).abs() < 0.12)
        img[:, inside] = torch.tensor(COLORS[color], dtype=torch.float32)[:, None]
    dot = (xx - grip[0]) ** 2 + (yy - grip[1]) ** 2 < 0.06 ** 2
    img[:, dot] = 255.0
    return img.to(torch.uint8)
