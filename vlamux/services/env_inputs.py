"""The Environment Service's input checks: each names the argument that was wrong and what it takes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from vlamux.data.errors import DatasetError
from vlamux.envs.base import EnvSpec
from vlamux.errors import InvalidInputError
from vlamux.specs import build


def tenant_name(tenant) -> str:
    if not isinstance(tenant, str) or not tenant:
        raise InvalidInputError(f"tenant: expected a non-empty string, got {tenant!r}")
    return tenant


def env_spec(spec) -> EnvSpec:
    """An EnvSpec, or a mapping of its fields (checked by the spec itself, errors naming spec.<field>)."""
    if isinstance(spec, Mapping):
        spec = build(EnvSpec, dict(spec), "spec")
    if not isinstance(spec, EnvSpec):
        raise InvalidInputError(f"spec: expected an EnvSpec, got {type(spec).__name__}")
    return spec


def count(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise InvalidInputError(f"{name}: expected a positive int, got {v!r}")
    return int(v)


def gpu_index(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise InvalidInputError(f"{name}: expected a non-negative GPU index, got {v!r}")
    return int(v)


def gpu_indices(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise InvalidInputError(f"render_devices: expected a list of GPU indices or None, got {v!r}")
    return [gpu_index("render_devices[]", d) for d in v]


def seed_value(seed) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidInputError(f"seed: expected a non-negative int or None, got {seed!r}")
    return int(seed)


def seconds(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InvalidInputError(f"{name}: expected a positive number of seconds, got {v!r}")
    return float(v)


def idle_seconds(name: str, v) -> float | None:
    return None if v is None else seconds(name, v)


def quota(name: str, v) -> int | None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise InvalidInputError(f"{name}: expected a non-negative int or None, got {v!r}")
    return v


def env_indices(indices, n_envs: int) -> list[int]:
    try:
        out = [int(i) for i in np.asarray(indices).reshape(-1)]
    except (TypeError, ValueError):
        raise InvalidInputError(f"indices: expected env indices, got {indices!r}") from None
    bad = [i for i in out if not 0 <= i < n_envs]
    if bad or not out:
        raise InvalidInputError(f"indices: {bad or 'empty'} out of range for {n_envs} envs")
    return out


def actions_array(actions, n_envs: int, dim: int, n_action_steps: int) -> np.ndarray:
    """[n_envs, A] or a chunk [n_envs, H, A] as float32 [n_envs, H, A], its executed steps finite."""
    if isinstance(actions, torch.Tensor):
        actions = actions.detach().to("cpu", torch.float32).numpy()
    try:
        a = np.asarray(actions, dtype=np.float32)
    except (TypeError, ValueError):
        raise InvalidInputError(f"actions: expected a float array, got {type(actions).__name__}") from None
    if a.ndim == 2:
        a = a[:, None]
    if a.ndim != 3 or a.shape[0] != n_envs or a.shape[1] < 1 or a.shape[2] != dim:
        raise InvalidInputError(f"actions: expected [{n_envs}, {dim}] or [{n_envs}, H, {dim}], "
                                f"got {list(np.shape(actions))}")
    if not np.isfinite(a[:, :n_action_steps]).all():
        raise InvalidInputError("actions: contain NaN or infinite values")
    return a


def check_dataset_root(root: str | Path, allowed: Sequence[Path] | None) -> Path:
    """`root` as a path this service may read a dataset from (under one of `allowed`, if given)."""
    path = Path(root).expanduser()
    if allowed is not None:
        resolved = path.resolve()
        if not any(resolved == a or a in resolved.parents for a in allowed):
            raise DatasetError(f"dataset root {str(root)!r}: outside the directories this service may read")
    if not path.exists():
        raise DatasetError(f"dataset root {str(root)!r}: no such file or directory")
    return path
