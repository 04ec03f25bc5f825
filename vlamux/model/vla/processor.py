"""A LeRobot policy's processors, as its checkpoint configures them (policy_preprocessor.json,
policy_postprocessor.json and their statistics): camera frames to the VLM's images, the task to tokens
(π0.5: with the state's bins in the prompt), the state and actions to and from the policy's units.

Frames come as vlamux carries them (uint8 [B, 3, H, W], each camera named as the checkpoint's
`observation.images.<name>` feature), states [B, S] and actions [B, T, A] in the robot's units.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from vlamux.errors import InvalidInputError
from vlamux.model.vla.checkpoint import POST, LeRobotCheckpoint

EPS = 1e-8  # lerobot's normalizer


@dataclass(frozen=True)
class PrefixSpec:
    """What a LeRobot backbone needs of a tenant to make its rows' prefix: the checkpoint's cameras in
    order, the prompt's length and padding, its family (π0.5 writes the state's bins in the prompt)
    and the number of tokens of its own it adds at the prefix's end (SmolVLA's state token)."""

    family: str
    cameras: tuple[str, ...]
    max_length: int
    padding: str
    own_tokens: int
    max_state: int = 32  # the width the state is zero-padded to before π0.5 bins it


class Processor:
    def __init__(self, ckpt: LeRobotCheckpoint, vlm_dir: Path | None):
        from transformers import AutoTokenizer

        self.family = ckpt.family
        cfg = ckpt.config
        self.cameras = ckpt.cameras()
        self.state_dim, self.action_dim = ckpt.state_dim(), ckpt.action_dim()
        self.max_state, self.max_action = int(cfg.get("max_state_dim", 32)), int(cfg.get("max_action_dim", 32))
        self.chunk = int(cfg.get("chunk_size", 50))
        size = cfg.get("resize_imgs_with_padding") or cfg.get("image_resolution") or [224, 224]
        self.image_hw = (int(size[0]), int(size[1]))
        tok = ckpt.pre_step("tokenizer_processor")
        tcfg = tok["config"] if tok else {}
        self.max_length = int(tcfg.get("max_length", cfg.get("tokenizer_max_length", 48)))
        self.padding = tcfg.get("padding", "max_length")
        if vlm_dir is None:
            raise InvalidInputError(f"vlm: the tokenizer of {ckpt.vlm_hub_id()!r} is needed (a local copy of that "
                                    f"hub repository's tokenizer files)")
        self.tokenizer = AutoTokenizer.from_pretrained(str(vlm_dir), local_files_only=True)
        modes = ckpt.norm_modes()
        self.state_mode, self.action_mode = modes.get("STATE", "MEAN_STD"), modes.get("ACTION", "MEAN_STD")
        self.stats = {k: v.to(torch.float32) for k, v in ckpt.stats.items()}
        post = next((s for s in ckpt.post.get("steps", []) if s.get("state_file")), None)
        if post is not None and (ckpt.path / post["state_file"]).is_file():
            from safetensors.torch import load_file

            self.post_stats = {k: v.to(torch.float32) for k, v in load_file(str(ckpt.path / post["state_file"])).items()}
        else:
            raise InvalidInputError(f"{ckpt.path.name}/{POST}: no unnormalizer statistics")

    # ---- images -------------------------------------------------------------------------------------
    def images(self, frames: dict[str, Tensor]) -> list[Tensor]:
        """Each checkpoint camera's frames (uint8 [B, 3, H, W]) as the VLM takes them: [B, 3, h, w] in
        [-1, 1], resized with padding as the family does."""
        missing = [c for c in self.cameras if c not in frames]
        if missing:
            raise InvalidInputError(f"obs.images: the policy reads cameras {self.cameras}; missing {missing}")
        return [vlm_image(frames[c].to(torch.float32) / 255.0, self.family, self.image_hw) for c in self.cameras]

    # ---- language -----------------------------------------------------------------------------------
    def prompts(self, tasks: list[str], state: Tensor | None) -> list[str]:
        """The text each row's tokens come from (`prompts`), from the state in the robot's units."""
        if self.family != "pi05":
            return prompts(tasks, self.family, None)
        return prompts(tasks, self.family, self.pad(self.normalize_state(state), self.max_state))

    def tokens(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        enc = self.tokenizer(prompts, max_length=self.max_length, truncation=True, padding=self.padding,
                             padding_side="right", return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"].bool()

    # ---- state and actions --------------------------------------------------------------------------
    def normalize_state(self, state: Tensor) -> Tensor:
        return self._normalize(state, "observation.state", self.state_mode, self.stats)

    def normalize_actions(self, actions: Tensor) -> Tensor:
        return self._normalize(actions, "action", self.action_mode, self.stats)

    def unnormalize_actions(self, x: Tensor) -> Tensor:
        """The policy's normalised chunk [B, T, max_action] -> the robot's first `action_dim` dims."""
        x = x[..., :self.action_dim]
        st = self.post_stats
        if self.action_mode == "QUANTILES":
            q01, q99 = st["action.q01"], st["action.q99"]
            d = q99 - q01
            d = torch.where(d == 0, torch.full_like(d, EPS), d)
            return (x + 1.0) * d / 2.0 + q01
        if self.action_mode == "MEAN_STD":
            return x * st["action.std"] + st["action.mean"]
        return x

    @staticmethod
    def _normalize(x: Tensor, key: str, mode: str, st: dict) -> Tensor:
        if mode == "QUANTILES":
            q01, q99 = st[f"{key}.q01"], st[f"{key}.q99"]
            d = q99 - q01
            d = torch.where(d == 0, torch.full_like(d, EPS), d)
            return 2.0 * (x - q01) / d - 1.0
        if mode == "MEAN_STD":
            return (x - st[f"{key}.mean"]) / (st[f"{key}.std"] + EPS)
        return x

    @staticmethod
    def pad(x: Tensor, n: int) -> Tensor:
        """Zero-padded along the last dimension to `n`."""
        return F.pad(x, (0, n - x.shape[-1])) if x.shape[-1] < n else x


def vlm_image(x: Tensor, family: str, hw: tuple[int, int]) -> Tensor:
    """Frames [B, 3, H, W] in [0, 1] -> the VLM's size `hw` in [-1, 1], resized with padding as the
    family does."""
    th, tw = hw
    h, w = x.shape[-2:]
    if family == "smolvla":  # always resized; padded on the left and top with 0
        ratio = max(w / tw, h / th)
        nh, nw = int(h / ratio), int(w / ratio)
        x = F.interpolate(x, size=(nh, nw), mode="bilinear", align_corners=False)
        x = F.pad(x, (tw - nw, 0, th - nh, 0), value=0.0)
    elif (h, w) != (th, tw):  # π0: resized when the size differs, centred, padded with -1 (before x2-1)
        ratio = max(w / tw, h / th)
        nh, nw = int(h / ratio), int(w / ratio)
        x = F.interpolate(x, size=(nh, nw), mode="bilinear", align_corners=False).clamp(-1.0, 1.0)
        top, left = (th - nh) // 2, (tw - nw) // 2
        x = F.pad(x, (left, tw - nw - left, top, th - nh - top), value=-1.0)
    return x * 2.0 - 1.0


def prompts(tasks: list[str], family: str, state: Tensor | None) -> list[str]:
    """The text each row's tokens come from: the task and a newline (SmolVLA, π0), or π0.5's
    "Task: ..., State: <bins>;\\nAction: " from the normalised state `state` (a host tensor, padded to
    the policy's state width) in 256 bins over [-1, 1]."""
    if family != "pi05":
        return [t if t.endswith("\n") else t + "\n" for t in tasks]
    if state is None:
        raise InvalidInputError("state: a π0.5 policy writes the state into its prompt; the observation has none")
    bins = np.digitize(state.double().numpy(), np.linspace(-1, 1, 257)[:-1]) - 1
    return [f"Task: {t.strip().replace('_', ' ').replace(chr(10), ' ')}, State: {' '.join(map(str, row))};\nAction: "
            for t, row in zip(tasks, bins.tolist())]
