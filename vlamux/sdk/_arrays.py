"""Client-side shaping of observations and actions into the wire layout (docs/API.md, Payloads)."""

from __future__ import annotations

from typing import Any

import numpy as np


def observation(obs: dict) -> dict:
    """``{"images": {cam: uint8 [B, 3, H, W]}, "state": float32 [B, S], "instructions": [str] * B}``.

    Accepts numpy arrays, nested lists, or torch tensors; ``instruction`` is accepted for
    ``instructions`` (the environments' own spelling), and one string is repeated over the batch.
    The server checks everything again and names the field when something is wrong.
    """
    if not isinstance(obs, dict):
        raise TypeError(f"observation: expected a dict with images, instructions, state; got {type(obs).__name__}")
    out: dict[str, Any] = {}
    images = obs.get("images")
    if isinstance(images, dict):
        out["images"] = {str(c): array(v, np.uint8) for c, v in images.items()}
    else:
        out["images"] = images
    instr = obs.get("instructions", obs.get("instruction"))
    if isinstance(instr, str):
        batch = next((a.shape[0] for a in out["images"].values() if isinstance(a, np.ndarray) and a.ndim), 1) \
            if isinstance(out["images"], dict) and out["images"] else 1
        instr = [instr] * batch
    elif instr is not None and not isinstance(instr, list):
        instr = [str(s) for s in instr]
    out["instructions"] = instr
    if obs.get("state") is not None:
        out["state"] = array(obs["state"], np.float32)
    return out


def floats(a) -> np.ndarray:
    return array(a, np.float32)


def array(a, dtype) -> Any:
    if hasattr(a, "detach") and hasattr(a, "numpy"):  # a torch tensor
        a = a.detach().cpu().numpy()
    if isinstance(a, np.ndarray):
        if dtype is np.float32 and a.dtype.kind == "f" and a.dtype != np.float32:
            return a.astype(np.float32)
        return a
    if isinstance(a, (list, tuple)):
        return np.asarray(a, dtype=dtype)
    return a
