"""What the API accepts: JSON request bodies as pydantic models, msgpack observations and actions
converted to the model core's types, and checks of head, optimizer and env specs, every error
naming its field."""

from __future__ import annotations

import dataclasses
import math
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


# Bounds that keep one request from taking the machine's memory; far above any real head.
_HEAD_INTS = {"action_dim": (1, 1024), "horizon": (1, 1024), "width": (1, 4096), "depth": (1, 64),
              "n_heads": (1, 256), "state_dim": (0, 4096), "feature_layers": (0, 64)}


_OPTION_MIN = {"n_bins": 2}  # the bins head's own lower bound (vlamux/model/heads/bins.py)


def check_head(head, where: str = "head") -> None:
    """A head spec, checked before anything is built: every refusal names its field.

    `HeadSpec` checks most of this too, but its messages name no field ("head spec: horizon must
    ..."), and the head's kind and options are only checked when the head is built, inside a
    service (a 500 for a slot, a failed job for a job spec)."""
    from vlamux.model.heads import HEADS, HeadSpec

    if not isinstance(head, dict):
        return  # the spec loader names it
    head = {**{f.name: f.default for f in dataclasses.fields(HeadSpec) if f.default is not dataclasses.MISSING},
            **head}
    if "kind" in head and (not isinstance(head["kind"], str) or head["kind"] not in HEADS):
        raise invalid(f"{where}.kind", f"unknown kind {head['kind']!r}; choose one of {sorted(HEADS)}")
    for name, (lo, hi) in _HEAD_INTS.items():
        v = head.get(name)
        if name in head and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            raise invalid(f"{where}.{name}", f"must be an integer in [{lo}, {hi}], got {v!r}")
    width, n_heads, depth = head.get("width", 1), head.get("n_heads", 1), head.get("depth", 0)
    if width % n_heads:
        raise invalid(f"{where}.width", f"{width} is not a multiple of n_heads {n_heads}")
    if head.get("feature_layers", 0) not in (0, depth):
        raise invalid(f"{where}.feature_layers", f"must be 0 or depth ({depth}), got {head['feature_layers']!r}")
    if "instruction_cond" in head and head["instruction_cond"] not in ("none", "add", "adaln"):
        raise invalid(f"{where}.instruction_cond", f"one of 'none', 'add', 'adaln', got {head['instruction_cond']!r}")
    options = head.get("options")
    if options is not None and head.get("kind") in HEADS:
        if not isinstance(options, dict):
            raise invalid(f"{where}.options", f"expected a map, got {type(options).__name__}")
        allowed = HEADS[head["kind"]].DEFAULT_OPTIONS
        for k, v in options.items():
            f = f"{where}.options.{k}"
            if k not in allowed:
                raise invalid(f, f"unknown option for kind {head['kind']!r}; allowed: {sorted(allowed)}")
            if isinstance(allowed[k], int):
                lo = _OPTION_MIN.get(k, 1)
                if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 4096:
                    raise invalid(f, f"must be an integer in [{lo}, 4096], got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > 1e6:
                raise invalid(f, f"must be a finite number, got {v!r}")
    if head.get("adapter") is not None:
        from vlamux.errors import InvalidInputError
        from vlamux.model.adapters import LoRASpec

        try:
            LoRASpec.from_dict(head["adapter"], where=f"{where}.adapter")
        except InvalidInputError as e:  # its message starts with the field it names
            raise invalid(str(e).split(":", 1)[0], str(e).split(":", 1)[1].strip()) from None


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


def check_optimizer(optim, where: str = "optimizer") -> None:
    """An optimizer spec's values, named by field (`OptimizerSpec` names none, and torch's own
    refusal of a beta >= 1 comes from inside the training service, as a 500)."""
    if not isinstance(optim, dict):
        return  # the spec loader names it

    def number(k):
        v = optim[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise invalid(f"{where}.{k}", f"expected a finite number, got {v!r}")
        return v

    for k, ok, why in (("lr", lambda v: 0 < v <= 10, "in (0, 10]"),
                       ("weight_decay", lambda v: 0 <= v <= 10, "in [0, 10]"),
                       ("eps", lambda v: 0 < v <= 1, "in (0, 1]"), ("grad_clip", lambda v: v > 0, "> 0 (or null)")):
        if k in optim and optim[k] is not None and not ok(number(k)):
            raise invalid(f"{where}.{k}", f"must be {why}, got {optim[k]!r}")
    if "betas" in optim:
        betas = optim["betas"]
        if (not isinstance(betas, list) or len(betas) != 2
                or not all(not isinstance(b, bool) and isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            raise invalid(f"{where}.betas", f"expected two numbers in [0, 1), got {betas!r}")


def check_env(env, where: str = "env") -> None:
    """An env spec's shape, before a simulator is started for it; values are the service's to check."""
    from vlamux.envs import EnvSpec

    if not isinstance(env, dict):
        raise invalid(where, f"expected a map (an env spec), got {type(env).__name__}")
    known = {f.name for f in dataclasses.fields(EnvSpec)}
    for k in env:
        if k not in known:
            raise invalid(f"{where}.{k}", f"unknown field; allowed: {', '.join(sorted(known))}")
    for k in ("backend", "task"):
        if k in env and (not isinstance(env[k], str) or not env[k] or len(env[k]) > 256):
            raise invalid(f"{where}.{k}", f"expected a name of at most 256 characters, got {str(env[k])[:80]!r}")
    from vlamux.envs import BACKENDS, check_task

    backend = env.get("backend", "tabletop")
    why = check_task(backend, env.get("task", "goal/touch-red-cube"))
    if why is not None:  # known to be wrong without starting a simulator
        raise invalid(f"{where}.backend" if backend not in BACKENDS else f"{where}.task", why)
    from vlamux.jobs.spec import RANGES

    for k, (lo, hi) in RANGES["EnvSpec"].items():
        v = env.get(k)
        if k in env and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            raise invalid(f"{where}.{k}", f"must be an integer in [{lo}, {hi}], got {v!r}")
    cams = env.get("cameras")
    if "cameras" in env and (not isinstance(cams, list) or not 1 <= len(cams) <= 16
                             or not all(isinstance(c, str) and c for c in cams)):
        raise invalid(f"{where}.cameras", f"expected a list of 1 to 16 camera names, got {cams!r}")
    if "options" in env and not isinstance(env["options"], dict):
        raise invalid(f"{where}.options", f"expected a map, got {type(env['options']).__name__}")


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
