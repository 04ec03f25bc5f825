"""Tenant observations and their canonical form, the backbone's input schema.

A tenant sends an `Observation` in its own shape (any camera names and
image sizes, any instruction). `canonicalize` turns it into a
`CanonicalBatch` the backbone understands: images resized to the backbone's
resolution and scaled, cameras stacked in the tenant's order with a
present-mask, the instruction tokenized. `CanonicalBatch.concat` pads a list
of them to one group batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from vlamux.errors import InvalidInputError
from vlamux.model.device import to_device
from vlamux.model.tokenizer import ByteTokenizer


@dataclass(frozen=True)
class InputSchema:
    """What a backbone accepts: the target of canonicalisation."""

    image_size: int
    max_cameras: int
    max_text_tokens: int


@dataclass
class Observation:
    """One tenant's batch of observations.

    images: camera name -> uint8 [B, 3, H, W]; every camera of a batch shares B.
    instruction: B strings.
    state: optional float32 [B, S] proprio state (read by heads, not the backbone).
    camera_mask: optional camera name -> bool [B], False where that camera is absent.
    """

    images: dict[str, Tensor]
    instruction: list[str]
    state: Tensor | None = None
    camera_mask: dict[str, Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.instruction)

    def validate(self, schema: InputSchema) -> None:
        if not isinstance(self.instruction, (list, tuple)) or not all(isinstance(s, str) for s in self.instruction):
            raise InvalidInputError("instruction: expected a list of strings")
        b = len(self.instruction)
        if b == 0:
            raise InvalidInputError("instruction: empty batch")
        if not isinstance(self.images, dict) or not self.images:
            raise InvalidInputError("images: at least one camera is required")
        if len(self.images) > schema.max_cameras:
            raise InvalidInputError(
                f"images: {len(self.images)} cameras given, the backbone takes at most {schema.max_cameras}"
            )
        for name, img in self.images.items():
            where = f"images[{name!r}]"
            if not isinstance(img, Tensor):
                raise InvalidInputError(f"{where}: expected a tensor, got {type(img).__name__}")
            if img.dtype != torch.uint8:
                raise InvalidInputError(f"{where}: expected dtype uint8, got {img.dtype}")
            if img.dim() != 4 or img.shape[1] != 3:
                raise InvalidInputError(f"{where}: expected shape [B, 3, H, W], got {list(img.shape)}")
            if img.shape[0] != b:
                raise InvalidInputError(f"{where}: batch {img.shape[0]} != {b} instructions")
            if min(img.shape[2:]) < 1:
                raise InvalidInputError(f"{where}: empty image {list(img.shape)}")
        for name, m in self.camera_mask.items():
            if name not in self.images:
                raise InvalidInputError(f"camera_mask[{name!r}]: no such camera in images")
            if not isinstance(m, Tensor) or m.dtype != torch.bool or m.shape != (b,):
                got = f"{m.dtype} {list(m.shape)}" if isinstance(m, Tensor) else type(m).__name__
                raise InvalidInputError(f"camera_mask[{name!r}]: expected a bool tensor [{b}], got {got}")
        if self.state is not None:
            check_float_tensor("state", self.state, (b, None))


def check_float_tensor(name: str, t, shape: tuple) -> None:
    """Raise InvalidInputError unless `t` is a finite float tensor of `shape` (None = any size)."""
    if not isinstance(t, Tensor):
        raise InvalidInputError(f"{name}: expected a tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise InvalidInputError(f"{name}: expected a float tensor, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise InvalidInputError(f"{name}: expected shape [{want}], got {list(t.shape)}")
    if not torch.isfinite(t).all():
        raise InvalidInputError(f"{name}: contains NaN or infinite values")


@dataclass
class CanonicalBatch:
    pixels: Tensor  # float [B, K, 3, R, R], scaled to [-1, 1]
    camera_mask: Tensor  # bool [B, K]
    tokens: Tensor  # int64 [B, T]
    token_mask: Tensor  # bool [B, T]

    @property
    def batch_size(self) -> int:
        return self.pixels.shape[0]

    @property
    def n_cameras(self) -> int:
        return self.pixels.shape[1]

    @property
    def text_len(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def concat(batches: list[CanonicalBatch]) -> CanonicalBatch:
        """One batch holding all rows, cameras and text padded (and masked) to the widest."""
        if len(batches) == 1:
            return batches[0]
        k = max(b.n_cameras for b in batches)
        t = max(b.text_len for b in batches)
        return CanonicalBatch(
            pixels=torch.cat([_pad_dim(b.pixels, 1, k) for b in batches]),
            camera_mask=torch.cat([_pad_dim(b.camera_mask, 1, k) for b in batches]),
            tokens=torch.cat([_pad_dim(b.tokens, 1, t) for b in batches]),
            token_mask=torch.cat([_pad_dim(b.token_mask, 1, t) for b in batches]),
        )


def _pad_dim(x: Tensor, dim: int, size: int) -> Tensor:
    missing = size - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def canonicalize(obs: Observation, schema: InputSchema, tokenizer: ByteTokenizer, device=None,
                 dtype: torch.dtype = torch.float32) -> CanonicalBatch:
    """Validate `obs` and map it onto the backbone's input schema."""
    if not isinstance(obs, Observation):
        raise InvalidInputError(f"obs: expected an Observation, got {type(obs).__name__}")
    obs.validate(schema)
    size = schema.image_size
    views, masks = [], []
    for name, img in obs.images.items():
        x = to_device(img, device).to(torch.float32)  # resize in fp32: not every kernel has bf16
        if tuple(x.shape[2:]) != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        views.append(x.mul_(2.0 / 255.0).sub_(1.0).to(dtype))
        m = obs.camera_mask.get(name)
        masks.append(torch.ones(obs.batch_size, dtype=torch.bool, device=device) if m is None else to_device(m, device))
    tokens, token_mask = tokenizer(list(obs.instruction))
    return CanonicalBatch(
        pixels=torch.stack(views, dim=1),
        camera_mask=torch.stack(masks, dim=1),
        tokens=to_device(tokens, device),
        token_mask=to_device(token_mask, device),
    )


def _tensor(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:  # e.g. unpickled from a read-only buffer; torch wants to own writable memory
        a = a.copy()
    return torch.from_numpy(a)


def obs_to_observation(obs: Mapping[str, Any]) -> Observation:
    """A batched env observation (``{"images": {cam: uint8 [B,3,H,W]}, "state": [B,S], "instruction": [B]}``)
    as the model core's `Observation`. The tensors share memory with the arrays (no copy) unless an array
    is read-only or not contiguous."""
    if isinstance(obs, Observation):
        return obs
    try:
        images = {str(c): _tensor(np.asarray(v)) for c, v in obs["images"].items()}
        state = obs.get("state")
        if state is not None:
            state = np.asarray(state)
            if state.dtype != np.float32:
                state = state.astype(np.float32)
            state = _tensor(state)
        instruction = [str(s) for s in obs["instruction"]]
    except (KeyError, TypeError, AttributeError) as e:
        raise InvalidInputError(f"obs: expected a dict with 'images', 'state' and 'instruction' ({e})") from None
    return Observation(images=images, instruction=instruction, state=state)
