"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
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


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read a MiB at a time."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_path(path: str | Path, durable: bool = True):
    """A fresh path beside `path` to write the new file to (the caller creates it: it gets the process's
    usual permissions); on a clean exit it is fsynced and renamed over `path`, so a reader, or a crash at
    any point, sees the old file or the new one, never half of one. On an error it is removed.
    durable=False: no fsync (scratch files no restart reads: whole to this process, not to a crash)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield tmp
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str, newline: str | None = None) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "x", newline=newline) as f:
            f.write(text)


def atomic_save_safetensors(tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str],
                            durable: bool = True) -> None:
    with atomic_path(path, durable) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def read_verified(path: str | Path, fmt: str, what: str, legacy_ok: bool = False):
    """(tensors, metadata) of a safetensors file written with `fmt` in its metadata and a
    `content_sha256` (tensors_sha256), verified: it reads whole, hashes to that digest, and holds only
    finite numbers; else CorruptCheckpointError (or IncompatibleError for another format) saying which.
    legacy_ok: accept a file without a digest (written before files carried one), finite still."""
    import logging

    from safetensors import safe_open
    from safetensors.torch import load_file

    from vlamux.errors import CorruptCheckpointError, IncompatibleError

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types, and OSError
        raise CorruptCheckpointError(f"{path}: not a readable safetensors file, truncated or overwritten "
                                     f"({type(e).__name__}: {e})") from None
    if meta.get("format") != fmt:
        raise IncompatibleError(f"{path}: not a vlamux {what} (format={meta.get('format')!r})")
    want = meta.get("content_sha256")
    if want is None and legacy_ok:
        logging.getLogger(__name__).warning("%s: a %s without a content digest (an earlier version's); "
                                            "not verified", path, what)
    elif tensors_sha256(tensors) != want:
        raise CorruptCheckpointError(f"{path}: its tensors do not match the sha256 they were saved with; "
                                     f"the file was altered or damaged after it was written")
    bad = next((k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if bad is not None:
        raise CorruptCheckpointError(f"{path}: tensor {bad!r} holds NaN or infinite values; a policy from it "
                                     f"would act on garbage")
    return tensors, meta
