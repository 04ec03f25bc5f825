"""A tenant's policy as one file, and running it with no server.

    import vlamux.policy
    policy = vlamux.policy.load("acme.policy.safetensors", backbone="tiny-tabletop")   # or a model dir
    out = policy.act(obs)            # float32 [B, H, A]: the chunk the service returns for obs

    policy = vlamux.policy.load("smolvla_ckpt/", vlm="SmolVLM2-500M-Video-Instruct/")  # a LeRobot checkpoint
    policy.act(obs, noise=x0)        # lerobot's chunk for that noise
    policy.save_lerobot("out/")      # back out as a LeRobot checkpoint

The file (safetensors) holds the tenant's module only: the head's and adapter's weights and the
normalisation statistics, the head's spec, the policy version, and the backbone's id and content hash;
never the shared backbone's weights. `load` refuses a backbone whose content hash differs, naming
both. Inference is the service's own code path (`ModelRunner` with one slot), so the actions are the
service's for the same observation: exactly with `deterministic=True`, and for a seeded sampler,
those of a replica whose slot starts from the same seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from vlamux.errors import IncompatibleError
from vlamux.model import BackboneSpec, HeadSpec, build_backbone
from vlamux.model.backbones import spec_from_arg
from vlamux.model.backbones.base import Backbone
from vlamux.model.batch import obs_to_observation
from vlamux.model.group import Sample
from vlamux.model.runner import ModelRunner
from vlamux.model.snapshot import PolicySnapshot
from vlamux.model.slot_file import MODULE_PREFIXES
from vlamux.utils.io import atomic_save_safetensors, read_verified, tensors_sha256

FORMAT = "vlamux.policy/1"
TENANT = "policy"  # the one slot of a standalone runner


def write_policy(snap: PolicySnapshot, backbone: Backbone | str, path: str | Path) -> Path:
    """`snap` (a slot's `export_policy()`, or `snapshot_of` a checkpoint) as a policy file for
    `backbone` (the one it was trained on, or its content hash)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in snap.ready().tensors.items() if isinstance(v, torch.Tensor)}
    digest = backbone if isinstance(backbone, str) else backbone_sha256(backbone)
    meta = {"format": FORMAT, "head_spec": snap.head_spec.to_json(), "stats_modes": json.dumps(snap.stats_modes),
            "policy_version": str(snap.version), "backbone_id": snap.backbone_id,
            "backbone_sha256": digest, "content_sha256": tensors_sha256(tensors)}
    atomic_save_safetensors(tensors, path, meta)
    return Path(path)


def snapshot_of(slot_file: str | Path) -> PolicySnapshot:
    """The policy in a slot checkpoint (verified): its module and statistics, without the optimizer."""
    from vlamux.model.slot_file import read_slot_file

    tensors, meta = read_slot_file(slot_file)
    keep = {k: v for k, v in tensors.items() if k.startswith((*MODULE_PREFIXES, "stats."))}
    return PolicySnapshot(meta["tenant"], int(tensors["version"][0]), meta["backbone_id"],
                          HeadSpec.from_json(meta["head_spec"]), keep, json.loads(meta["stats_modes"]))


def backbone_sha256(backbone: Backbone) -> str:
    digest = getattr(backbone, "content_sha256", None)
    if digest is None:  # built by hand, not by build_backbone: hash what it holds
        digest = tensors_sha256({k: v.detach().float().cpu() for k, v in backbone.state_dict().items()})
        backbone.content_sha256 = digest
    return digest


def read_policy(path: str | Path) -> tuple[dict, dict]:
    """A policy file's tensors and metadata, verified (readable, its digest, finite)."""
    return read_verified(path, FORMAT, "policy file")


class Policy:
    """A loaded policy: its backbone (frozen, yours) and its module, in a runner of its own."""

    def __init__(self, runner: ModelRunner, meta: dict):
        self.runner, self.meta = runner, meta
        self.head_spec = HeadSpec.from_json(meta["head_spec"])
        self.version = int(meta["policy_version"])

    @property
    def backbone(self) -> Backbone:
        return next(iter(self.runner.backbones.values()))

    def act(self, obs, deterministic: bool = True, seed: int | None = None, noise=None) -> np.ndarray:
        """The action chunk for each row of `obs` (the wire layout: ``{"images": {cam: uint8 [B, 3,
        H, W]}, "state": float32 [B, S], "instructions": [str] * B}``, or an env observation with
        "instruction"): float32 [B, H, A]. seed: restart the sampler's random stream from it first;
        noise: a flow policy's starting noise [B, H, A'] (as lerobot's `noise=`), instead of a draw
        (deterministic: zeros)."""
        from vlamux.model.device import to_numpy

        if isinstance(obs, dict) and "instructions" in obs and "instruction" not in obs:
            obs = {**obs, "instruction": obs["instructions"]}
        if seed is not None:
            self.runner.slot(TENANT).generator.manual_seed(int(seed))
        if noise is not None:
            noise = torch.as_tensor(np.asarray(noise) if not isinstance(noise, torch.Tensor) else noise,
                                    dtype=torch.float32)
        out = self.runner.execute([Sample(TENANT, obs_to_observation(obs), deterministic, noise)])[0].unwrap()
        return to_numpy(out["actions"])

    def save_lerobot(self, out: str | Path) -> Path:
        """This policy as a LeRobot checkpoint directory (a policy imported from one: its VLM, expert,
        statistics and processors), which lerobot's `from_pretrained` reads."""
        from vlamux.model.vla.export import write_lerobot

        slot = self.runner.slot(TENANT)
        return write_lerobot(out, self.backbone.ckpt_dir, self.backbone.content_sha256, slot.head_spec,
                             slot.policy_tensors(),
                             {k: v.mode for k, v in slot.stats.items()})


def load(path: str | Path, backbone: str | BackboneSpec | Backbone | None = None, device: str = "cpu",
         dtype: torch.dtype = torch.float32, vlm: str | Path | None = None) -> Policy:
    """Load a policy file onto `backbone` (a preset or shipped weights name, a model directory, a
    BackboneSpec, or a built backbone), on `device`. Refuses a backbone other than the policy's own.
    A LeRobot checkpoint directory (SmolVLA, π0, π0.5) loads whole: its VLM as the backbone, with
    `vlm` the directory of the VLM/tokenizer files it names by hub id."""
    from vlamux.model.vla.checkpoint import is_lerobot_checkpoint

    if is_lerobot_checkpoint(path):
        if backbone is None:
            backbone = BackboneSpec(kind="lerobot", path=str(path), vlm=None if vlm is None else str(vlm))
        if isinstance(backbone, BackboneSpec):
            backbone = build_backbone(backbone, device=device, dtype=dtype)
        runner = ModelRunner(backbone)
        slot = runner.import_lerobot(TENANT, path)
        return Policy(runner, {"head_spec": slot.head_spec.to_json(), "policy_version": "0",
                               "backbone_id": backbone.backbone_id, "backbone_sha256": backbone.content_sha256})
    if backbone is None:
        raise ValueError(f"{path}: a policy file names the backbone it runs on: give backbone=")
    if isinstance(backbone, str):
        backbone = spec_from_arg(backbone)
    if isinstance(backbone, BackboneSpec):
        backbone = build_backbone(backbone, device=device, dtype=dtype)
    snap, meta = policy_snapshot(path, backbone, TENANT)
    runner = ModelRunner(backbone)
    runner.apply_policy(snap)
    return Policy(runner, meta)


def policy_snapshot(path: str | Path, backbone: Backbone, tenant: str) -> tuple[PolicySnapshot, dict]:
    """A policy file as `tenant`'s snapshot on `backbone` (verified, and refused for another backbone
    than its own), and the file's metadata."""
    tensors, meta = read_policy(path)
    theirs, mine = meta["backbone_sha256"], backbone_sha256(backbone)
    if theirs != mine:
        raise IncompatibleError(f"{path}: trained on backbone {meta['backbone_id']!r} (sha256 {theirs[:16]}...), "
                                f"not on {backbone.backbone_id!r} (sha256 {mine[:16]}...)")
    snap = PolicySnapshot(tenant, int(meta["policy_version"]), backbone.backbone_id,
                          HeadSpec.from_json(meta["head_spec"]), tensors, json.loads(meta["stats_modes"]))
    return snap, meta


def is_policy_file(path: str | Path) -> bool:
    """Whether `path` is a policy file (by its metadata; a slot checkpoint is not)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # noqa: BLE001 - not a readable safetensors file: not a policy file either
        return False
