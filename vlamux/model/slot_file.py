"""A slot's checkpoint file: everything of one tenant (its module, optimizer state, statistics, RNG,
policy version) as safetensors tensors with metadata and a content digest.

Tensors: `head.*`, `adapter.*`, `queries.*` (the tenant's module), `optim.{i}.{name}` (AdamW's state
per parameter), `stats.{action,state}.*`, `rng` (a CPU generator's state), `version`. Metadata:
format, tenant, backbone_id, seed, head_spec, optim_spec, param_groups, stats_modes, rng_device and
content_sha256. Files of earlier versions (no digest; a CUDA slot's Philox RNG state) still load.
The functions take a `vlamux.model.slot.Slot` (which calls them: this module does not import it).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from vlamux.errors import IncompatibleError, InvalidInputError
from vlamux.model.heads import HeadSpec
from vlamux.model.normalize import NormStats
from vlamux.utils.io import atomic_save_safetensors, read_verified, tensors_sha256

log = logging.getLogger(__name__)

FORMAT = "vlamux.slot/1"
MODULE_PREFIXES = ("head.", "adapter.", "queries.")  # the tenant's module's tensors in slot and policy files


def state_tensors(slot) -> tuple[dict[str, Tensor], dict[str, str]]:
    tensors = {k: v.detach().cpu().contiguous() for k, v in slot.module_state().items()}
    opt = slot.optimizer.state_dict() if slot.optimizer is not None else {"state": {}, "param_groups": []}
    for idx, st in opt["state"].items():
        for k, v in st.items():
            tensors[f"optim.{idx}.{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
    for name, stats in slot.stats.items():
        tensors.update(stats.tensors(f"stats.{name}"))
    tensors["rng"] = slot.generator.get_state()  # a CPU generator's state, whatever the slot's device
    tensors["version"] = torch.tensor([slot.version], dtype=torch.int64)
    meta = {
        "format": FORMAT, "tenant": slot.tenant, "backbone_id": slot.backbone_id, "seed": str(slot.seed),
        "head_spec": slot.head_spec.to_json(), "optim_spec": json.dumps(asdict(slot.optim_spec)),
        "param_groups": json.dumps(opt["param_groups"]),
        "stats_modes": json.dumps({k: v.mode for k, v in slot.stats.items()}),
        "rng_device": "cpu",  # the generator's type (files of earlier versions may say "cuda")
    }
    if slot.optimizer is None:
        meta["optimizer"] = "none"  # a serving copy's
    return tensors, meta


def save(slot, path: str | Path) -> None:
    if slot.accumulated:
        raise InvalidInputError(f"save: tenant {slot.tenant!r} has un-stepped gradients; call optim_step first")
    tensors, meta = state_tensors(slot)
    atomic_save_safetensors(tensors, path, {**meta, "content_sha256": tensors_sha256(tensors)})


def load(slot, path: str | Path) -> None:
    """Everything is checked before anything changes, and a failure half-way restores the slot."""
    tensors, meta = read_slot_file(path)
    if meta["tenant"] != slot.tenant:
        raise IncompatibleError(f"{path}: belongs to tenant {meta['tenant']!r}, not {slot.tenant!r}")
    if HeadSpec.from_json(meta["head_spec"]) != slot.head_spec:
        raise IncompatibleError(f"{path}: head spec {meta['head_spec']} differs from the slot's")
    if meta["backbone_id"] != slot.backbone_id:
        raise IncompatibleError(f"{path}: trained on backbone {meta['backbone_id']!r}, slot uses "
                                f"{slot.backbone_id!r}")
    module = {k: v for k, v in tensors.items() if k.startswith(MODULE_PREFIXES)}
    expected = slot.module_state()
    if module.keys() != expected.keys() or any(module[k].shape != expected[k].shape for k in module):
        raise IncompatibleError(f"{path}: its module's tensors (head, adapter, query tokens) do not match the slot's")
    live, live_meta = state_tensors(slot)
    backup = ({k: v.clone() for k, v in live.items()}, live_meta)  # on CPU .cpu() aliases the parameters
    try:
        restore(slot, tensors, meta)
    except Exception as e:
        restore(slot, *backup)
        raise IncompatibleError(f"{path}: could not be restored ({e}); the slot is unchanged") from e


def restore(slot, tensors: dict[str, Tensor], meta: dict[str, str]) -> None:
    """Put a slot file's state into `slot`, unchecked (`load` checks first; a parked slot is this
    process's own)."""
    own = slot.module_state()
    given = {k: v for k, v in tensors.items() if k.startswith(MODULE_PREFIXES)}
    if given.keys() != own.keys() or any(given[k].shape != own[k].shape for k in own):
        raise IncompatibleError(f"tenant {slot.tenant!r}: the state's module tensors do not match the slot's")
    keys = list(own)
    with torch.no_grad():  # in place: what load_state_dict does, without its walk of the modules
        if all(given[k].device == own[k].device for k in keys):
            torch._foreach_copy_([own[k] for k in keys], [given[k] for k in keys])
        else:
            for k in keys:  # from pinned memory asynchronously: the caller waits (`Lane.paging`)
                own[k].copy_(given[k], non_blocking=given[k].is_pinned())
    state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, idx, name = k.split(".", 2)
            state.setdefault(int(idx), {})[name] = v
    if slot.optimizer is not None and meta.get("optimizer") != "none":
        slot.optimizer.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
        for group in slot.optimizer.param_groups:  # the kernel is this device's choice, not the file's
            group["fused"], group["foreach"] = slot.fused_step(), None
    slot.optim_spec = type(slot.optim_spec)(**json.loads(meta["optim_spec"]))
    modes = json.loads(meta["stats_modes"])
    slot.stats = {k: NormStats.from_tensors(tensors, f"stats.{k}", m).to(slot.device) for k, m in modes.items()}
    slot.generator.set_state(generator_state(tensors["rng"], meta.get("rng_device", "cpu"), slot.tenant))
    slot.version = int(tensors["version"][0])
    slot.drop_gradients()


def generator_state(rng: Tensor, rng_device: str, tenant: str) -> Tensor:
    """The CPU generator state to resume from a slot file's "rng". Files written by this version hold
    a CPU (MT19937) state, used as is on every device. Files of earlier versions saved from a CUDA slot
    hold a Philox state (seed, offset: 16 bytes) that no CPU generator can continue; it is mapped to
    a CPU generator seeded from both numbers, so the resumed stream is deterministic and distinct
    per (seed, offset), though not the continuation the GPU would have drawn."""
    if rng_device == "cpu":
        return rng
    if rng_device != "cuda" or rng.numel() != 16:
        raise IncompatibleError(f"tenant {tenant!r}: cannot resume a {rng_device!r} generator state of "
                                f"{rng.numel()} bytes")
    seed, offset = (int(v) for v in rng.to(torch.uint8).view(torch.int64))
    log.warning("tenant %r: checkpoint from a CUDA slot of an earlier version; its RNG (Philox seed %d, "
                "offset %d) resumes as a CPU stream seeded from both", tenant, seed, offset)
    g = torch.Generator()
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + offset) % (2 ** 63))
    return g.get_state()


def read_slot_file(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """A slot file's tensors and metadata, verified (`read_verified`); files of earlier versions
    carry no digest and are checked for finiteness only."""
    return read_verified(path, FORMAT, "slot file", legacy_ok=True)
