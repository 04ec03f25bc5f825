"""A LeRobot checkpoint as a tenant: the backbone it goes onto, the head spec its expert is rebuilt
from, the slot that holds its expert, and the normalisation statistics that slot applies (lerobot's MEAN_STD as mean/std; QUANTILES as min/max over q01..q99,
the same arithmetic; IDENTITY as identity)."""

from __future__ import annotations

import torch

from vlamux.errors import IncompatibleError, InvalidInputError
from vlamux.model.heads.base import HeadSpec
from vlamux.model.normalize import NormStats
from vlamux.model.slot import Slot
from vlamux.model.vla.checkpoint import LeRobotCheckpoint
from vlamux.model.vla.experts import expert_dims


def head_spec(ckpt: LeRobotCheckpoint, heads: int, kv_heads: int, head_dim: int) -> HeadSpec:
    """The spec of the tenant's `lerobot` head: the expert's dims (from its tensors), and what its rows'
    prefix needs (its cameras, its prompt's length and padding), for a VLM of this attention layout."""
    dims = expert_dims(ckpt.family, ckpt.module_tensors(), ckpt.config, heads, kv_heads, head_dim)
    step = ckpt.pre_step("tokenizer_processor")
    tok = step["config"] if step else {}
    options = {**dims, "cameras": ckpt.cameras(), "max_length": int(tok.get("max_length", 48)),
               "padding": str(tok.get("padding", "max_length")),
               "max_state": int(ckpt.config.get("max_state_dim", 32)),
               # what a policy written back out as a LeRobot checkpoint repeats (vlamux.model.vla.export)
               "lerobot": {"config": ckpt.config, "preprocessor": ckpt.pre, "postprocessor": ckpt.post,
                           "dtype": str(next(iter(ckpt.module_tensors().values())).dtype).removeprefix("torch.")}}
    return HeadSpec("lerobot", action_dim=ckpt.action_dim(), horizon=dims["chunk"], state_dim=ckpt.state_dim(),
                    width=dims["width"], depth=dims["layers"], n_heads=dims["heads"], instruction_cond="none",
                    options=options)


def norm_stats(ckpt: LeRobotCheckpoint) -> dict[str, NormStats]:
    """{"state", "action"}: the checkpoint's normaliser statistics as the slot applies them."""
    out, modes = {}, ckpt.norm_modes()
    for name, key, kind, dim in (("state", "observation.state", "STATE", ckpt.state_dim()),
                                 ("action", "action", "ACTION", ckpt.action_dim())):
        mode, st = modes.get(kind, "MEAN_STD"), ckpt.stats
        if mode == "IDENTITY" or dim == 0:
            out[name] = NormStats.identity(dim)
            continue
        need = ("mean", "std") if mode == "MEAN_STD" else ("q01", "q99")
        missing = [f"{key}.{f}" for f in need if f"{key}.{f}" not in st]
        if missing:
            raise InvalidInputError(f"{ckpt.path.name}: the normalizer's statistics lack {missing}")
        mean = st.get(f"{key}.mean", torch.zeros(dim)).float()
        std = st.get(f"{key}.std", torch.ones(dim)).float()
        if mode == "MEAN_STD":
            lo, hi = st.get(f"{key}.min", mean - std).float(), st.get(f"{key}.max", mean + std).float()
            out[name] = NormStats(mean, std, torch.minimum(lo, hi), torch.maximum(lo, hi), "mean_std")
        elif mode == "QUANTILES":
            out[name] = NormStats(mean, std, st[f"{key}.q01"].float(), st[f"{key}.q99"].float(), "min_max")
        else:
            raise InvalidInputError(f"{ckpt.path.name}: normalisation mode {mode!r} of {kind} is not one vlamux "
                                    f"applies (MEAN_STD, QUANTILES, IDENTITY)")
    return out


def backbone_for(ckpt: LeRobotCheckpoint, backbones: list) -> object:
    """The backbone whose VLM is the checkpoint's (by the content hash of its tensors); none is an
    error that names both hashes."""
    want = ckpt.vlm_sha256()
    for b in backbones:
        if getattr(b, "kind", None) == "lerobot" and b.content_sha256 == want:
            return b
    have = ", ".join(f"{b.backbone_id} (sha256 {b.content_sha256})" for b in backbones)
    raise IncompatibleError(f"{ckpt.path.name}: its VLM tensors (sha256 {want}) are not this runner's backbone's: "
                            f"{have}; import it onto a backbone built from a checkpoint with the same VLM")


def imported_slot(tenant: str, ckpt: LeRobotCheckpoint, backbone, optim=None, seed: int = 0) -> Slot:
    """A slot on `backbone` (the checkpoint's VLM) holding the checkpoint's expert and its statistics."""
    vlm = backbone.vlm
    slot = Slot(tenant, head_spec(ckpt, vlm.heads, vlm.kv_heads, vlm.head_dim), backbone.meta, optim, seed,
                backbone.device)
    with torch.no_grad():
        missing, unexpected = slot.head.expert.load_state_dict(ckpt.module_tensors(), strict=False)
    if missing or unexpected:
        raise InvalidInputError(f"{ckpt.path.name}: its expert's tensors do not fit a {ckpt.family} expert "
                                f"(missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})")
    stats = norm_stats(ckpt)
    slot.set_stats(action=stats["action"], state=stats["state"] if ckpt.state_dim() else None)
    return slot
