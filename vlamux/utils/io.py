"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor


def tensors_sha256(tensors: dict[str, Tensor]) -> str:
    """A digest of CPU tensors' names, dtypes, shapes and bytes, in name order: what a file that holds
    them must hash to once read back, whatever the file's own byte layout."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{list(tensors[name].shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())  # CPU tensors only: checkpoints are moved off the device
    return h.hexdigest()


def atomic_save_safetensors(tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
