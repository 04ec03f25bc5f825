"""What the API accepts: JSON request bodies as pydantic models, and msgpack observations and actions
converted to the model core's types, every error naming its field. Head, optimizer, env and job specs
check themselves (vlamux.specs): their errors name the field too."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from vlamux import wire
from vlamux.api.errors import ApiError, field_of


MAX_INSTRUCTION_CHARS = 4096  # a tokenizer truncates far sooner; longer is a client's mistake

# ---- request bodies (JSON) ---------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QuotasIn(_Body):
    max_concurrent_jobs: int | None = Field(default=None, ge=0, le=1000)
    max_training_slots: int | None = Field(default=None, ge=0, le=1000)
    max_env_sessions: int | None = Field(default=None, ge=0, le=1000)
    max_envs: int | None = Field(default=None, ge=0, le=100000)
    max_env_processes: int | None = Field(default=None, ge=0, le=10000)
    max_dataset_mb: float | None = Field(default=None, ge=0, le=10**7)
    requests_per_s: float | None = Field(default=None, gt=0, le=100000)


class TenantIn(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    quotas: QuotasIn | None = None


class KeyIn(_Body):
    name: str = Field(default="", max_length=64)


class SlotIn(_Body):
    head: dict[str, Any]
    optimizer: dict[str, Any] | None = None
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    name: str | None = Field(default=None, max_length=64)
    backbone: str | None = Field(default=None, min_length=1, max_length=128)  # a name from GET /v1/backbones


class OptimStepIn(_Body):
    lr: float | None = Field(default=None, gt=0, le=10)


class LoadStateIn(_Body):
    checkpoint_id: str = Field(min_length=1, max_length=64)


class SessionIn(_Body):
    env: dict[str, Any]
    n_envs: int = Field(default=1, ge=1, le=64)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)


class ResetIn(_Body):
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)


MSGPACK = {"requestBody": {"required": True, "content": {wire.CONTENT_TYPE: {"schema": {"type": "string",
                                                                                      "format": "binary"}}}}}
MSGPACK_OUT = {200: {"content": {wire.CONTENT_TYPE: {}}, "description": "msgpack document"}}


# ---- conversions -------------------------------------------------------------------------------
def invalid(field: str, why: str) -> ApiError:
    return ApiError(422, "invalid_input", f"{field}: {why}", field)


def observation(d, where: str = "observation"):
    """A wire observation -> `Observation`, every check naming its field."""
    import torch

    from vlamux.model import Observation

    if not isinstance(d, dict):
        raise invalid(where, "expected a map with images, instructions, state")
    images = d.get("images")
    if not isinstance(images, dict) or not images:
        raise invalid(f"{where}.images", "a map camera -> uint8 [B, 3, H, W]")
    if len(images) > 16:
        raise invalid(f"{where}.images", f"at most 16 cameras, got {len(images)}")
    instr = d.get("instructions")
    if not isinstance(instr, list) or not instr or not all(isinstance(s, str) for s in instr):
        raise invalid(f"{where}.instructions", "expected a non-empty list of strings, one per row")
    longest = max(len(s) for s in instr)
    if longest > MAX_INSTRUCTION_CHARS:
        raise invalid(f"{where}.instructions", f"at most {MAX_INSTRUCTION_CHARS} characters each, got {longest}")
    out = {}
    for cam, img in images.items():
        f = f"{where}.images.{cam}"
        if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 4 or img.shape[1] != 3:
            got = f"{img.dtype} {list(img.shape)}" if isinstance(img, np.ndarray) else type(img).__name__
            raise invalid(f, f"expected uint8 [B, 3, H, W], got {got}")
        if not (1 <= img.shape[2] <= 1024 and 1 <= img.shape[3] <= 1024):
            raise invalid(f, f"images from 1x1 up to 1024x1024, got {img.shape[2]}x{img.shape[3]}")
        if img.shape[0] != len(instr):
            raise invalid(f"{where}.instructions",
                           f"{len(instr)} instructions for an image batch of {img.shape[0]} ({cam})")
        out[cam] = torch.from_numpy(img)
    state = d.get("state")
    if state is not None:
        state = floats(state, f"{where}.state", ndim=2)
        if state.shape[0] != len(instr):
            raise invalid(f"{where}.state", f"batch {state.shape[0]} != {len(instr)} instructions")
    return Observation(out, list(instr), state)


def floats(a, field: str, ndim: int):
    import torch

    if not isinstance(a, np.ndarray) or a.dtype.kind != "f" or a.ndim != ndim:
        got = f"{a.dtype} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
        raise invalid(field, f"expected a float array of {ndim} dims, got {got}")
    with np.errstate(over="ignore"):
        a = a.astype(np.float32)  # before the check: a float64 1e300 is infinite as float32
    if not np.isfinite(a).all():
        raise invalid(field, "contains NaN or infinity (as float32)")
    return torch.from_numpy(a)


def fits_head(head: dict | None, obs=None, actions=None) -> None:
    """What the policy's head expects of a request: state width, action chunk shape (a head without
    state ignores one sent: an env's observations carry state whatever the policy reads)."""
    if not isinstance(head, dict):
        return
    state_dim = head.get("state_dim", 0)
    if obs is not None and state_dim and obs.state is None:
        raise invalid("observation.state", f"this policy reads a state of width {state_dim}; none was sent")
    if obs is not None and state_dim and obs.state is not None and obs.state.shape[1] != state_dim:
        raise invalid("observation.state", f"this policy reads a state of width {state_dim}, "
                                            f"got {obs.state.shape[1]}")
    if actions is not None and tuple(actions.shape[1:]) != (head.get("horizon"), head.get("action_dim")):
        raise invalid("actions", f"this policy's action chunks are [B, {head.get('horizon')}, "
                                  f"{head.get('action_dim')}], got {list(actions.shape)}")


def head_error(e: ValueError, where: str = "head") -> ApiError | None:
    """A head the training service would not build ("head spec: feature_layers=8 but the backbone
    has 4 layers"): the caller's input, so a 422 naming the field where the message says which."""
    import re

    from vlamux.model.heads import HeadSpec

    msg = str(e)
    if not msg.startswith("head spec:"):
        return None
    why = msg.split(":", 1)[1].strip()
    name = re.match(r"[A-Za-z_][A-Za-z0-9_.]*", why)
    name = name.group(0) if name else ""
    fields = {f.name for f in dataclasses.fields(HeadSpec)}
    field = f"{where}.{name}" if name.split(".")[0] in fields else where
    return invalid(field, why)


def env_error(e: Exception, where: str = "env") -> ApiError:
    """The environment service names its argument `spec`; over the API the field is `env`."""
    msg = str(e)
    field = field_of(msg)
    if field and (field == "spec" or field.startswith("spec.")):
        return invalid(where + field[4:], msg.split(":", 1)[1].strip())
    if field in ("n_envs", "seed") or (field and field.startswith(where + ".")):
        return invalid(field, msg.split(":", 1)[1].strip())
    return invalid(where, msg)


def obs_out(obs) -> dict:
    """A batched env observation -> the wire layout (the same layout `observation` reads)."""
    out = {"images": {str(c): np.ascontiguousarray(v) for c, v in obs["images"].items()},
           "instructions": [str(s) for s in obs["instruction"]]}
    if obs.get("state") is not None:
        out["state"] = np.asarray(obs["state"], np.float32)
    return out
