"""A slot below resident: parked (its whole state as host tensors) or stored (the same, in a slot
file on disk), and back, byte for byte.

A parked slot holds everything a resident one does: the module, the optimizer's state and
hyperparameters (a learning rate changed since creation included), the gradients of forward_backward
calls not yet stepped and their norm, the statistics, the RNG and the policy version. Unparked, it
continues exactly where it left off: the same outputs, the same optimizer trajectory, the same random
draws. The tensors are in the slot file's layout (`vlamux.model.slot_file`), gradients added as
`grad.{i}` (the i-th trainable parameter's), so a stored slot is a checkpoint any vlamux reads; a slot
holding gradients is never stored (a checkpoint has none).

Parking copies; unparking builds a new `Slot` (a new object: caches keyed by a slot's identity, such
as the fused heads' stacks, cannot mistake it for the old one) with its tensors allocated, not
initialised, and copies the state in. The parked
slot's tensors may become the new slot's (on a CPU the copies alias): unparking consumes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from vlamux.errors import InvalidInputError
from vlamux.model import slot_file
from vlamux.model.feature import FeatureMeta
from vlamux.model.heads import HeadSpec
from vlamux.model.slot import OptimizerSpec, Slot
from vlamux.model.slot_file import MODULE_PREFIXES
from vlamux.utils.io import atomic_path, atomic_save_safetensors, tensors_sha256


@dataclass(frozen=True)
class SlotBytes:
    """A slot's bytes by part: what each tier must hold for it."""
    params: int
    optimizer: int
    grads: int
    stats: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.grads + self.stats


@dataclass
class ParkedSlot:
    tenant: str
    backbone_id: str
    tensors: dict[str, Tensor]  # host tensors, slot file layout + grad.{i} and grad_norm
    meta: dict[str, str]  # slot file metadata + "accumulated"

    @property
    def holds_gradients(self) -> bool:
        return int(self.meta.get("accumulated", "0")) > 0

    def nbytes(self) -> SlotBytes:
        def size(prefixes):
            return sum(t.numel() * t.element_size() for k, t in self.tensors.items() if k.startswith(prefixes))

        return SlotBytes(params=size(MODULE_PREFIXES), optimizer=size(("optim.",)), grads=size(("grad.", "grad_norm")),
                         stats=size(("stats.",)))


def park(slot: Slot) -> ParkedSlot:
    """A copy of all of `slot`'s state on the host (the slot itself is left as it was)."""
    tensors, meta = slot_file.state_tensors(slot)
    if slot.device.type == "cpu":  # there state_tensors' .cpu() aliased the slot's own (elsewhere they are copies)
        tensors = packed_copy(tensors)
    elif slot.device.type == "cuda":  # pinned: its copy back to the device is asynchronous (`unpark`)
        tensors = packed_copy(tensors, pinned=True)
    for i, p in enumerate(slot.params):
        if p.grad is not None:
            tensors[f"grad.{i}"] = p.grad.detach().to("cpu", copy=True)
    if slot._grad_norm is not None:
        tensors["grad_norm"] = slot._grad_norm.detach().to("cpu", copy=True)
    return ParkedSlot(slot.tenant, slot.backbone_id, tensors, {**meta, "accumulated": str(slot.accumulated)})


def shell_key(head_spec_json: str, backbone_id: str, trainable: bool) -> tuple:
    """What a slot object must match to take another tenant's parked state (`unpark(shell=)`); the head
    spec as its JSON (`HeadSpec.to_json`, as a parked slot's metadata holds it)."""
    return head_spec_json, backbone_id, trainable


def packed_copy(tensors: dict[str, Tensor], pinned: bool = False) -> dict[str, Tensor]:
    """Copies of `tensors` (host tensors) as views of one new buffer per dtype: one allocation and one
    copy for a slot's fifty-odd tensors instead of fifty (a parked slot's tensors are only ever read
    whole). pinned: in page-locked memory (a CUDA slot's, which then copies to its device asynchronously)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for k, v in tensors.items():
        by_dtype.setdefault(v.dtype, []).append(k)
    out = {}
    for dtype, keys in by_dtype.items():
        flat = torch.empty(sum(tensors[k].numel() for k in keys), dtype=dtype, pin_memory=pinned)
        torch.cat([tensors[k].reshape(-1) for k in keys], out=flat)
        for k, part in zip(keys, flat.split([tensors[k].numel() for k in keys])):
            out[k] = part.view(tensors[k].shape)
    return out


def unpark(parked: ParkedSlot, feature_meta: FeatureMeta, device="cpu", shell: Slot | None = None,
           **backbone) -> Slot:
    """The slot `parked` was, on `device` (`backbone`: `Slot`'s keyword arguments for an adapter or query
    tokens). Consumes `parked`. shell: a slot object no runner holds any more (one just parked), of the
    same `shell_key`, to copy the state into instead of building a new one: building a head's modules
    costs milliseconds, copying its tensors in a fraction of one. The shell becomes the slot."""
    meta, tensors = parked.meta, parked.tensors
    if feature_meta.backbone_id != parked.backbone_id:
        raise InvalidInputError(f"tenant {parked.tenant!r} was parked from backbone {parked.backbone_id!r}, "
                                f"not {feature_meta.backbone_id!r}")
    trainable = meta.get("optimizer") != "none"
    if shell is not None:
        if shell_key(shell.head_spec.to_json(), shell.backbone_id, shell.optimizer is not None) != \
                shell_key(meta["head_spec"], parked.backbone_id, trainable) or shell.device != torch.device(device):
            raise ValueError(f"tenant {parked.tenant!r}: the shell given is a slot of another kind")
        slot = shell
        slot.tenant, slot.seed = parked.tenant, int(meta["seed"])
        slot._host_copies = {}
    else:
        slot = Slot(parked.tenant, HeadSpec.from_json(meta["head_spec"]), feature_meta, OptimizerSpec(**json.loads(meta["optim_spec"])),
                    seed=int(meta["seed"]), device=device, init=False, trainable=trainable, **backbone)
    slot_file.restore(slot, tensors, meta)
    params = slot.params
    with torch.no_grad():
        for k, g in tensors.items():
            if k.startswith("grad."):
                p = params[int(k[5:])]
                p.grad = g.to(p.device, copy=True)
    slot.accumulated = int(meta.get("accumulated", "0"))
    norm = tensors.get("grad_norm")
    slot._grad_norm = None if norm is None else norm.to(slot.device, copy=True)
    return slot


def store(parked: ParkedSlot, path: str | Path, durable: bool = True) -> None:
    """Write `parked` as a slot file (a checkpoint: `Slot.load_state` and `read_stored` read it).
    durable=False: not fsynced (a service's spool, which no restart reads)."""
    tensors, meta = _file_parts(parked)
    atomic_save_safetensors(tensors, path, meta, durable)


def _file_parts(parked: ParkedSlot) -> tuple[dict[str, Tensor], dict[str, str]]:
    """A slot file's tensors (sharing no storage) and metadata (with their digest) for `parked`."""
    if parked.holds_gradients:
        raise InvalidInputError(f"tenant {parked.tenant!r} holds un-stepped gradients: a stored slot has none")
    meta = {k: v for k, v in parked.meta.items() if k != "accumulated"}
    tensors = {k: v.clone() for k, v in parked.tensors.items()}  # a file's tensors share no storage
    return tensors, {**meta, "content_sha256": tensors_sha256(tensors)}


def spool(parked: ParkedSlot, path: str | Path) -> str:
    """`store` for a service's spool (scratch no restart reads: not fsynced), serialised once. Returns
    the sha256 of the file's bytes, for `unspool`."""
    import hashlib

    from safetensors.torch import save

    tensors, meta = _file_parts(parked)
    data = save(tensors, meta)
    with atomic_path(path, durable=False) as tmp:
        Path(tmp).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def unspool(path: str | Path, digest: str) -> ParkedSlot:
    """A slot `spool` wrote, read back whole and checked against the digest it returned: one read, one
    hash over the bytes, one load. `read_stored`'s per-tensor digest and finiteness check make hundreds
    of calls, each giving up Python's lock, which a busy engine and its clients then hold; these bytes
    are those written from a slot in memory, so the one hash is check enough."""
    import hashlib

    from safetensors.torch import load

    from vlamux.errors import CorruptCheckpointError

    data = Path(path).read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        raise CorruptCheckpointError(f"{path}: a spooled slot whose bytes are not those written")
    n = int.from_bytes(data[:8], "little")  # safetensors: the header's length, then the header
    meta = json.loads(data[8:8 + n]).get("__metadata__", {})
    return ParkedSlot(meta["tenant"], meta["backbone_id"], load(data), {**meta, "accumulated": "0"})


def read_stored(path: str | Path) -> ParkedSlot:
    """A stored slot (any slot file) read back and verified, parked."""
    tensors, meta = slot_file.read_slot_file(path)
    return ParkedSlot(meta["tenant"], meta["backbone_id"], tensors, {**meta, "accumulated": "0"})
