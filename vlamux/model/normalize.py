"""Normalisation statistics of a tenant's state and actions (LeRobot's modes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vlamux.errors import InvalidInputError
from vlamux.model.device import to_device

MODES = ("mean_std", "min_max", "identity")
_FIELDS = ("mean", "std", "min", "max")
_FLOOR = 1e-4  # a constant dimension (std or range ~0) is centred, not blown up by 1/eps


@dataclass
class NormStats:
    """Per-dimension statistics of one feature; `mode` picks which ones apply."""

    mean: Tensor
    std: Tensor
    min: Tensor
    max: Tensor
    mode: str = "mean_std"

    def __post_init__(self):
        if self.mode not in MODES:
            raise InvalidInputError(f"stats mode: expected one of {MODES}, got {self.mode!r}")
        dims = {getattr(self, f).shape for f in _FIELDS}
        if len(dims) != 1:
            raise InvalidInputError(f"stats: mean/std/min/max shapes differ: {sorted(map(list, dims))}")
        for f in _FIELDS:
            if not torch.isfinite(getattr(self, f)).all():
                raise InvalidInputError(f"stats.{f}: contains NaN or infinite values")
        if (self.std < 0).any():
            raise InvalidInputError("stats.std: negative values")
        if (self.min > self.max).any():
            raise InvalidInputError("stats: min > max in some dimension")

    @staticmethod
    def identity(dim: int, mode: str = "identity") -> NormStats:
        z, o = torch.zeros(dim), torch.ones(dim)
        return NormStats(z, o, -o, o.clone(), mode)

    @staticmethod
    def from_data(x: Tensor, mode: str) -> NormStats:
        """Statistics over every leading dimension of x [..., D]."""
        flat = x.reshape(-1, x.shape[-1]).double()
        return NormStats(flat.mean(0).float(), flat.std(0, unbiased=False).float(), flat.amin(0).float(),
                         flat.amax(0).float(), mode)

    @property
    def dim(self) -> int:
        return self.mean.shape[-1]

    def to(self, device) -> NormStats:
        """A private copy on `device` (never shares storage with the caller's tensors)."""
        moved = {}
        for f in _FIELDS:
            src = getattr(self, f)
            t = to_device(src, device, torch.float32)
            moved[f] = t.clone() if t.data_ptr() == src.data_ptr() else t
        return NormStats._unchecked(moved, self.mode)  # checked once when made: re-checking on a GPU would wait

    @staticmethod
    def _unchecked(fields: dict[str, Tensor], mode: str) -> NormStats:
        out = object.__new__(NormStats)
        for f in _FIELDS:
            object.__setattr__(out, f, fields[f])
        out.mode = mode
        return out

    def normalize(self, x: Tensor) -> Tensor:
        if self.mode == "mean_std":
            return (x - self.mean) / self.std.clamp_min(_FLOOR)
        if self.mode == "min_max":
            return (x - self.min) / (self.max - self.min).clamp_min(_FLOOR) * 2.0 - 1.0
        return x

    def unnormalize(self, x: Tensor) -> Tensor:
        if self.mode == "mean_std":
            return x * self.std.clamp_min(_FLOOR) + self.mean
        if self.mode == "min_max":
            return (x + 1.0) * 0.5 * (self.max - self.min).clamp_min(_FLOOR) + self.min
        return x

    def tensors(self, prefix: str) -> dict[str, Tensor]:
        return {f"{prefix}.{f}": getattr(self, f).detach().cpu().contiguous() for f in _FIELDS}

    @staticmethod
    def from_tensors(tensors: dict[str, Tensor], prefix: str, mode: str) -> NormStats:
        return NormStats(*(tensors[f"{prefix}.{f}"] for f in _FIELDS), mode=mode)

    @staticmethod
    def placed(tensors: dict[str, Tensor], prefix: str, mode: str, device) -> NormStats:
        """Statistics a policy snapshot carries, on `device`, unchecked: they were checked where the
        snapshot was made, and its host tensors may still be filling (reading them would race)."""
        if mode not in MODES:
            raise InvalidInputError(f"stats mode: expected one of {MODES}, got {mode!r}")
        return NormStats._unchecked({f: tensors[f"{prefix}.{f}"] for f in _FIELDS}, mode).to(device)
