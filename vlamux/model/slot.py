"""A slot: one tenant's private state inside a model service.

It holds the tenant's action head, AdamW optimizer, RNG, normalisation
statistics and policy version, and touches nothing else: the backbone's
features come in as input. A request that fails (bad input, NaN loss or
gradient) leaves the slot exactly as it was.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open
from torch import Tensor

from vlamux.errors import IncompatibleError, InvalidInputError, NonFiniteError
from vlamux.model.batch import check_float_tensor
from vlamux.model.feature import FeatureMeta, VLAFeature
from vlamux.model.heads import ActionHead, HeadSpec, build_head
from vlamux.model.normalize import NormStats
from vlamux.model.policy_loss import PolicyLoss, policy_objective
from vlamux.utils.io import atomic_save_safetensors
from vlamux.utils.seeding import seeded

FORMAT = "vlamux.slot/1"


@dataclass
class OptimizerSpec:
    lr: float = 1e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # max global grad norm; None disables clipping

    def __post_init__(self):
        self.betas = tuple(self.betas)
        if not self.lr > 0:
            raise ValueError(f"optimizer spec: lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer spec: weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"optimizer spec: grad_clip must be > 0 or None, got {self.grad_clip}")


@dataclass(frozen=True)
class PolicySnapshot:
    """An immutable copy of a tenant's policy at one version: the control plane's unit."""

    tenant: str
    version: int
    backbone_id: str
    head_spec: HeadSpec
    tensors: dict  # "head.*" weights and "stats.*" statistics, on the CPU
    stats_modes: dict

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Slot:
    def __init__(self, tenant: str, head_spec: HeadSpec, feature_meta: FeatureMeta,
                 optim: OptimizerSpec | None = None, seed: int = 0, device: str | torch.device = "cpu"):
        if not tenant or not isinstance(tenant, str):
            raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")
        self.tenant = tenant
        self.head_spec = head_spec
        self.optim_spec = optim or OptimizerSpec()
        self.backbone_id = feature_meta.backbone_id
        self.seed = seed
        self.device = torch.device(device)
        with seeded(seed):
            self.head: ActionHead = build_head(head_spec, feature_meta.hidden_dim).to(self.device)
        o = self.optim_spec
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.generator = torch.Generator(self.device)
        self.generator.manual_seed(seed + 1)
        self.stats = {
            "action": NormStats.identity(head_spec.action_dim, self.head.ACTION_NORM).to(self.device),
            "state": NormStats.identity(head_spec.state_dim, "mean_std").to(self.device),
        }
        self.version = 0
        self.accumulated = 0  # forward_backward calls since the last optimizer step

    # ---- statistics -------------------------------------------------------------------------
    def set_stats(self, action: NormStats | None = None, state: NormStats | None = None) -> None:
        """Install dataset statistics; the action mode is the head's unless the stats are 'identity'.
        Both are checked before either is installed."""
        new = {}
        for name, stats, dim in (("action", action, self.head_spec.action_dim),
                                 ("state", state, self.head_spec.state_dim)):
            if stats is None:
                continue
            if stats.dim != dim:
                raise InvalidInputError(f"stats[{name!r}]: {stats.dim} dims, the head has {dim}")
            if name == "action" and stats.mode != "identity":
                stats = NormStats(stats.mean, stats.std, stats.min, stats.max, self.head.ACTION_NORM)
            new[name] = stats.to(self.device)
        self.stats.update(new)

    # ---- inputs -------------------------------------------------------------------------------
    def _state(self, state: Tensor | None, batch: int) -> Tensor | None:
        s = self.head_spec.state_dim
        if s == 0:
            return None  # this head reads no proprio state; ignore what the observation carries
        if state is None:
            raise InvalidInputError(f"state: the head of tenant {self.tenant!r} needs a proprio state [B, {s}]")
        check_float_tensor("state", state, (batch, s))
        return self.stats["state"].normalize(state.to(self.device, torch.float32))

    def _actions(self, actions: Tensor, action_mask: Tensor | None, batch: int) -> tuple[Tensor, Tensor]:
        h, a = self.head_spec.horizon, self.head_spec.action_dim
        check_float_tensor("actions", actions, (batch, h, a))
        if action_mask is None:
            action_mask = torch.ones(batch, h, dtype=torch.bool)
        elif not isinstance(action_mask, Tensor) or action_mask.dtype != torch.bool \
                or tuple(action_mask.shape) != (batch, h):
            got = f"{action_mask.dtype} {list(action_mask.shape)}" if isinstance(action_mask, Tensor) \
                else type(action_mask).__name__
            raise InvalidInputError(f"action_mask: expected a bool tensor [{batch}, {h}], got {got}")
        if not action_mask.any():
            raise InvalidInputError("action_mask: no valid step in the batch")
        actions = self.stats["action"].normalize(actions.to(self.device, torch.float32))
        return actions, action_mask.to(self.device)

    def _check_feature(self, feature: VLAFeature) -> VLAFeature:
        if feature.meta.backbone_id != self.backbone_id:
            raise IncompatibleError(f"tenant {self.tenant!r} is bound to backbone {self.backbone_id!r}, "
                                    f"got features of {feature.meta.backbone_id!r}")
        return feature.to(self.step_pos_dtype)

    @property
    def step_pos_dtype(self) -> torch.dtype:
        return self.head.step_pos.dtype

    # ---- operations ---------------------------------------------------------------------------
    def forward_backward(self, feature: VLAFeature, state: Tensor | None, actions: Tensor,
                         action_mask: Tensor | None = None, loss: PolicyLoss | None = None) -> dict:
        """Add this batch's gradients to the slot; returns the loss and head metrics. Without `loss`
        the head's supervised loss on `actions`; with it, the RL objective (then also the rows'
        current `log_prob`, a proximal policy for later epochs over the same batch)."""
        feature = self._check_feature(feature)
        b = feature.batch_size
        state_n = self._state(state, b)
        actions_n, mask = self._actions(actions, action_mask, b)
        if loss is not None:
            loss.check(b)
        rng = self.generator.get_state()
        extra = {}
        try:
            params = [p for p in self.head.parameters() if p.requires_grad]
            if loss is None:
                loss, metrics = self.head.loss(feature, state_n, actions_n, mask, self.generator)
            else:
                log_prob, entropy, value = self.head.evaluate(feature, state_n, actions_n, mask)
                loss, metrics = policy_objective(log_prob, entropy, value, loss)
                extra["log_prob"] = log_prob.detach().cpu()
            if not torch.isfinite(loss):
                raise NonFiniteError(f"tenant {self.tenant!r}: loss is {loss.item()}")
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            present = [g for g in grads if g is not None]
            if present and not torch.isfinite(torch.stack([g.sum() for g in present])).all():
                raise NonFiniteError(f"tenant {self.tenant!r}: gradient has NaN or infinite values")
        except BaseException:
            self.generator.set_state(rng)
            raise
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self.accumulated += 1
        return {"loss": loss.item(), **metrics, **extra}

    def optim_step(self) -> dict[str, float]:
        """Apply accumulated gradients; the policy version increases by one."""
        if self.accumulated == 0:
            raise InvalidInputError(f"optim_step: tenant {self.tenant!r} has no gradients since its last step")
        params = [p for p in self.head.parameters() if p.grad is not None]
        clip = self.optim_spec.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.accumulated = 0
        self.version += 1
        return {"grad_norm": norm.item(), "policy_version": self.version}

    @torch.no_grad()
    def sample(self, feature: VLAFeature, state: Tensor | None, deterministic: bool = False) -> dict:
        """An action chunk in the tenant's own units, stamped with the policy version."""
        feature = self._check_feature(feature)
        out = self.head.sample(feature, self._state(state, feature.batch_size), self.generator, deterministic)
        out["actions"] = self.stats["action"].unnormalize(out["actions"])
        out["policy_version"] = self.version
        return out

    # ---- control plane: policy snapshots ----------------------------------------------------
    def export_policy(self) -> PolicySnapshot:
        """The serving part of this slot (head weights, statistics, version): what inference replicas need."""
        tensors = {f"head.{k}": v.detach().to("cpu", copy=True) for k, v in self.head.state_dict().items()}
        for name, stats in self.stats.items():
            tensors.update(stats.tensors(f"stats.{name}"))
        return PolicySnapshot(self.tenant, self.version, self.backbone_id, self.head_spec, tensors,
                              {k: v.mode for k, v in self.stats.items()})

    def apply_policy(self, snap: PolicySnapshot) -> None:
        if snap.tenant != self.tenant or snap.head_spec != self.head_spec or snap.backbone_id != self.backbone_id:
            raise IncompatibleError(f"policy snapshot of tenant {snap.tenant!r} ({snap.head_spec.kind}) does not fit "
                                    f"the slot of tenant {self.tenant!r} ({self.head_spec.kind})")
        self.head.load_state_dict({k[5:]: v for k, v in snap.tensors.items() if k.startswith("head.")})
        self.stats = {k: NormStats.from_tensors(snap.tensors, f"stats.{k}", m).to(self.device)
                      for k, m in snap.stats_modes.items()}
        self.version = snap.version

    @classmethod
    def from_policy(cls, snap: PolicySnapshot, feature_meta: FeatureMeta, device="cpu") -> Slot:
        slot = cls(snap.tenant, snap.head_spec, feature_meta, device=device)
        slot.apply_policy(snap)
        return slot

    # ---- persistence --------------------------------------------------------------------------
    def state_tensors(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        """Everything of this tenant, as safetensors tensors + metadata."""
        tensors = {f"head.{k}": v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}
        opt = self.optimizer.state_dict()
        for idx, st in opt["state"].items():
            for k, v in st.items():
                tensors[f"optim.{idx}.{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
        for name, stats in self.stats.items():
            tensors.update(stats.tensors(f"stats.{name}"))
        tensors["rng"] = self.generator.get_state().cpu()  # layout depends on the generator's device type
        tensors["version"] = torch.tensor([self.version], dtype=torch.int64)
        meta = {
            "format": FORMAT, "tenant": self.tenant, "backbone_id": self.backbone_id, "seed": str(self.seed),
            "head_spec": self.head_spec.to_json(), "optim_spec": json.dumps(asdict(self.optim_spec)),
            "param_groups": json.dumps(opt["param_groups"]),
            "stats_modes": json.dumps({k: v.mode for k, v in self.stats.items()}),
            "rng_device": self.device.type,
        }
        return tensors, meta

    def save(self, path: str | Path) -> None:
        if self.accumulated:
            raise InvalidInputError(f"save: tenant {self.tenant!r} has un-stepped gradients; call optim_step first")
        tensors, meta = self.state_tensors()
        atomic_save_safetensors(tensors, path, meta)

    def load_state(self, path: str | Path) -> None:
        """Restore this tenant's state from a file it saved; refuses another tenant's or head's file.

        Everything is checked before anything changes, and a failure half-way restores the slot:
        a refused or broken load leaves the slot as it was.
        """
        tensors, meta = read_slot_file(path)
        if meta["tenant"] != self.tenant:
            raise IncompatibleError(f"{path}: belongs to tenant {meta['tenant']!r}, not {self.tenant!r}")
        if HeadSpec.from_json(meta["head_spec"]) != self.head_spec:
            raise IncompatibleError(f"{path}: head spec {meta['head_spec']} differs from the slot's")
        if meta["backbone_id"] != self.backbone_id:
            raise IncompatibleError(f"{path}: trained on backbone {meta['backbone_id']!r}, slot uses "
                                    f"{self.backbone_id!r}")
        if meta.get("rng_device", "cpu") != self.device.type:
            raise IncompatibleError(f"{path}: saved from a {meta.get('rng_device', 'cpu')} slot, this slot is on "
                                    f"{self.device.type}: its RNG state cannot resume here bit-identically")
        head = {k[5:]: v for k, v in tensors.items() if k.startswith("head.")}
        expected = self.head.state_dict()
        if head.keys() != expected.keys() or any(head[k].shape != expected[k].shape for k in head):
            raise IncompatibleError(f"{path}: head tensors do not match the slot's head")
        live, live_meta = self.state_tensors()
        backup = ({k: v.clone() for k, v in live.items()}, live_meta)  # on CPU .cpu() aliases the parameters
        try:
            self._restore(tensors, meta)
        except Exception as e:
            self._restore(*backup)
            raise IncompatibleError(f"{path}: could not be restored ({e}); the slot is unchanged") from e

    def newer_than(self, published: int) -> None:
        """After loading a checkpoint, move past the newest version already published: a policy
        version names one set of weights, forever, so a rollback gets a new number."""
        if self.version <= published:
            self.version = published + 1

    def _restore(self, tensors: dict[str, Tensor], meta: dict[str, str]) -> None:
        self.head.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("head.")})
        state: dict[int, dict] = {}
        for k, v in tensors.items():
            if k.startswith("optim."):
                _, idx, name = k.split(".", 2)
                state.setdefault(int(idx), {})[name] = v
        self.optimizer.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
        self.optim_spec = OptimizerSpec(**json.loads(meta["optim_spec"]))
        modes = json.loads(meta["stats_modes"])
        self.stats = {k: NormStats.from_tensors(tensors, f"stats.{k}", m).to(self.device) for k, m in modes.items()}
        self.generator.set_state(tensors["rng"])
        self.version = int(tensors["version"][0])
        self.optimizer.zero_grad(set_to_none=True)
        self.accumulated = 0

    @classmethod
    def from_file(cls, path: str | Path, feature_meta: FeatureMeta, device="cpu") -> Slot:
        _, meta = read_slot_file(path)
        opt = json.loads(meta["optim_spec"])
        slot = cls(meta["tenant"], HeadSpec.from_json(meta["head_spec"]), feature_meta, OptimizerSpec(**opt),
                   seed=int(meta["seed"]), device=device)
        slot.load_state(path)
        return slot


def read_slot_file(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"slot checkpoint not found: {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise IncompatibleError(f"{path}: not a vlamux slot file (format={meta.get('format')!r})")
    return load_file(str(path)), meta
