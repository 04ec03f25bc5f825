"""A LeRobot VLA policy run whole, outside the services: its VLM, its expert and its processors, as the
checkpoint and the VLM directory it names give them. The reference the services' grouped execution
of imported tenants is held to, and what `vlamux.policy.load(CKPT_DIR, vlm=DIR)` returns."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from vlamux.model.vla.checkpoint import LeRobotCheckpoint
from vlamux.model.vla.experts import Expert, build_expert, expert_dims
from vlamux.model.vla.flow import loss, sample
from vlamux.model.vla.processor import Processor
from vlamux.model.vla.vlm import VLM, PrefixKV, build_vlm, prefix_inputs, prefix_kv


class VLAPolicy:
    def __init__(self, ckpt_dir, vlm_dir=None):
        self.ckpt = LeRobotCheckpoint.read(ckpt_dir)
        self.family = self.ckpt.family
        vlm_dir = Path(vlm_dir) if vlm_dir is not None else None
        self.vlm: VLM = build_vlm(self.family, self.ckpt.vlm_tensors(), vlm_dir)
        module = self.ckpt.module_tensors()
        self.dims = expert_dims(self.family, module, self.ckpt.config, self.vlm.heads, self.vlm.kv_heads,
                                self.vlm.head_dim)
        self.expert: Expert = build_expert(self.dims).eval()
        self.expert.load_state_dict(module, strict=True)
        self.processor = Processor(self.ckpt, vlm_dir)
        self.steps = self.dims["steps"]

    def prefix(self, images: dict[str, Tensor], tasks: list[str], state: Tensor) -> tuple[PrefixKV, Tensor]:
        """The prefix's per-layer keys and values for a batch, and its normalised, padded state."""
        p = self.processor
        s = p.pad(p.normalize_state(state.to(torch.float32)), p.max_state)
        ids, mask = p.tokens(p.prompts(tasks, state.to(torch.float32)))
        cams = [self.vlm.embed_images(x) for x in p.images(images)]
        # SmolVLA: the state is the prefix's last token, after the language
        tokens = prefix_inputs(cams, self.vlm.embed_text(ids), mask, self.expert.state_token(s))
        return prefix_kv(self.vlm, *tokens), s

    @torch.no_grad()
    def act(self, images: dict[str, Tensor], tasks: list[str], state: Tensor, noise: Tensor | None = None,
            generator: torch.Generator | None = None) -> Tensor:
        """The un-normalised action chunk [B, T, action_dim]; `noise` [B, T, max_action] as the policy
        would draw it (default: a standard normal draw)."""
        kv, s = self.prefix(images, tasks, state)
        b = s.shape[0]
        if noise is None:
            noise = torch.randn(b, self.processor.chunk, self.processor.max_action, generator=generator)
        x = sample(self.expert, kv, noise.to(torch.float32), s, self.steps)
        return self.processor.unnormalize_actions(x)

    def loss(self, images: dict[str, Tensor], tasks: list[str], state: Tensor, actions: Tensor, noise: Tensor,
             time: Tensor) -> Tensor:
        """The training loss at `noise` and flow `time` [B], actions [B, T, action_dim] in robot units."""
        kv, s = self.prefix(images, tasks, state)
        p = self.processor
        a = p.pad(p.normalize_actions(actions.to(torch.float32)), p.max_action)
        dims = None if self.family == "smolvla" else p.action_dim  # SmolVLA averages over the padded dims too
        return loss(self.expert, kv, a, noise.to(torch.float32), time.to(torch.float32), s, dims)
