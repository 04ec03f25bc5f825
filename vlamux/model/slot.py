"""A slot: one tenant's private state inside a model service.

It holds the tenant's action head, AdamW optimizer, RNG, normalisation
statistics and policy version, and touches nothing else: the backbone's
features come in as input. A request that fails (bad input, NaN loss or
gradient) leaves the slot exactly as it was.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from vlamux.errors import IncompatibleError, InvalidInputError, NonFiniteError
from vlamux.model.adapters import LoRAAdapter, select_targets
from vlamux.model.queries import QueryTokens
from vlamux.model.device import copy_into, to_cpu, to_device
from vlamux.model.feature import FeatureMeta, VLAFeature
from vlamux.model.heads import ActionHead, HeadSpec, build_head
from vlamux.model.heads.base import host_noise
from vlamux.model.normalize import NormStats
from vlamux.model.policy_loss import PolicyLoss, policy_objective
from vlamux.model import slot_file
from vlamux.model.slot_file import MODULE_PREFIXES
from vlamux.specs import Bound, bounded, check
from vlamux.model.slot_inputs import FBInputs, PendingGrads, RowInputs, check_rows
from vlamux.model.snapshot import PolicySnapshot
from vlamux.utils.seeding import seeded



@dataclass
class OptimizerSpec:
    lr: float = bounded(1e-4, 0.0, 10.0, lo_open=True)
    weight_decay: float = bounded(0.01, 0.0, 10.0)
    betas: tuple[float, float] = bounded((0.9, 0.999), length=(2, 2), each=Bound(0.0, 1.0, hi_open=True))
    eps: float = bounded(1e-8, 0.0, 1.0, lo_open=True)
    grad_clip: float | None = bounded(1.0, 0.0, lo_open=True)  # max global grad norm; None disables clipping

    def __post_init__(self):
        check(self)
        self.betas = tuple(self.betas)


class Slot:
    def __init__(self, tenant: str, head_spec: HeadSpec, feature_meta: FeatureMeta,
                 optim: OptimizerSpec | None = None, seed: int = 0, device: str | torch.device = "cpu",
                 adaptable: dict | None = None, lora_default: tuple[str, ...] = (), query_init: dict | None = None,
                 init: bool = True, trainable: bool = True):
        """adaptable / lora_default: the backbone's Linears an adapter may change and its default
        targets (`Backbone.adaptable`, `LORA_DEFAULT`), for a head spec that carries an adapter;
        query_init: how the backbone takes query tokens (`Backbone.query_init`), for one with query_tokens.
        init=False: the module's tensors are allocated, not initialised (a state is copied in next:
        `vlamux.model.parking.unpark`), which skips the seeded initialisation's draws.
        trainable=False: a serving copy (an inference replica's, a standalone policy's): no optimizer,
        and a forward_backward on it is refused."""
        if not tenant or not isinstance(tenant, str):
            raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")
        self.tenant = tenant
        self.head_spec = head_spec
        self.optim_spec = optim or OptimizerSpec()
        self.backbone_id = feature_meta.backbone_id
        self.seed = seed
        self.device = torch.device(device)
        with seeded(seed):
            self.head: ActionHead = _placed(lambda: build_head(head_spec, feature_meta.hidden_dim, init), self.device, init)
        self.adapter: LoRAAdapter | None = None
        if head_spec.adapter is not None:
            if not adaptable:
                raise InvalidInputError(f"head.adapter: backbone {self.backbone_id!r} has no Linear an adapter may "
                                        f"change")
            targets = select_targets(adaptable, head_spec.lora, lora_default)
            with seeded(seed + 7919):
                self.adapter = _placed(lambda: LoRAAdapter(head_spec.lora, targets), self.device, init)
        self.queries: QueryTokens | None = None
        if head_spec.query_tokens:
            if not query_init:
                raise InvalidInputError(f"head.query_tokens: backbone {self.backbone_id!r} takes no query tokens "
                                        f"(a VLM backbone does)")
            with seeded(seed + 104729):
                self.queries = _placed(lambda: QueryTokens(head_spec.query_tokens, query_init["dim"], query_init["std"]),
                                       self.device, init)
        o = self.optim_spec
        # one optimizer over the tenant's whole module: head, then adapter, then query tokens
        self.optimizer = torch.optim.AdamW(self._module_params(), lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay, fused=self.fused_step()) if trainable else None
        # A CPU generator on every device: draws are made on the host and copied over (they are a few
        # numbers per action chunk), so a tenant's random stream is the same on a CPU and a GPU and
        # its state moves between them with a checkpoint, bit for bit.
        self.generator = torch.Generator()
        self.generator.manual_seed(seed + 1)
        self.stats = {
            "action": NormStats.identity(head_spec.action_dim, self.head.ACTION_NORM).to(self.device),
            "state": NormStats.identity(head_spec.state_dim, "mean_std").to(self.device),
        }
        self._host_copies: dict[str, tuple[NormStats, NormStats]] = {}  # `_host_stats`
        self.version = 0
        self.accumulated = 0  # forward_backward calls since the last optimizer step
        # the gradients' global norm when one forward_backward made them (its finiteness check computed
        # it): the step's clipping reuses it instead of a second pass over every gradient
        self._grad_norm: Tensor | None = None

    def fused_step(self) -> bool | None:
        """AdamW as one fused kernel where torch has one: a 9M-parameter module's step takes 8 ms
        against 26 ms tensor by tensor on one CPU thread (and one launch, not one per tensor, on CUDA)."""
        return True if self.device.type in ("cpu", "cuda") else None

    def _module_params(self) -> list[Tensor]:
        return [p for m in (self.head, self.adapter, self.queries) if m is not None for p in m.parameters()]

    @property
    def trains_backbone(self) -> bool:
        """Its gradients pass through the shared backbone (an adapter, query tokens, or tokens of its own
        in an imported policy's prefix)."""
        return self.adapter is not None or self.queries is not None or getattr(self.head, "trains_through_prefix",
                                                                                 False)

    @property
    def query_vectors(self) -> Tensor | None:
        return None if self.queries is None else self.queries.weight

    def prepare_kwargs(self) -> dict:
        """What the backbone's `prepare` needs of this tenant: its query tokens' count, or, for an imported
        policy's expert, its prefix (`PrefixSpec`: cameras, prompt, its own tokens) and state statistics."""
        if not hasattr(self.head, "prefix_spec"):
            return {"n_query": self.head_spec.query_tokens}
        return {"prefix": self.head.prefix_spec(), "state_stats": self._host_stats("state")}

    def _host_stats(self, name: str) -> NormStats:
        """A host copy of one of the statistics (made once per installed set: reading a device copy for
        each request would wait for the device)."""
        stats = self.stats[name]
        cached = self._host_copies.get(name)
        if cached is None or cached[0] is not stats:
            cached = self._host_copies[name] = (stats, stats.to("cpu"))
        return cached[1]

    def backbone_tokens(self, rows: RowInputs) -> Tensor | None:
        """This tenant's own vectors inside the shared forward for these rows: its query tokens [Q, D], or
        an imported policy's prefix tokens [B, n, D] (SmolVLA's projected state), or None."""
        if hasattr(self.head, "prefix_tokens"):
            return self.head.prefix_tokens(self._normal_state(rows))
        return self.query_vectors

    @property
    def params(self) -> list[Tensor]:
        """The trainable parameters (head, then adapter), in the order gradients are handed over (loads
        copy into them in place, so the list is built once)."""
        if getattr(self, "_params", None) is None:
            self._params = [p for p in self._module_params() if p.requires_grad]
        return self._params

    def module_state(self) -> dict[str, Tensor]:
        """The tenant's module's tensors by key: "head.*", "adapter.*" and "queries.*" where there are
        (detached views of the module's own tensors: built once, as `params` is, since every load copies
        into them in place and the modules are never replaced)."""
        if getattr(self, "_module_state", None) is None:
            self._module_state = {f"{name}.{k}": v for name, m in (("head", self.head), ("adapter", self.adapter),
                                                                   ("queries", self.queries)) if m is not None
                                  for k, v in m.state_dict().items()}
        return dict(self._module_state)

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
    def check_rows(self, batch: int, state: Tensor | None, actions: Tensor | None = None,
                   action_mask: Tensor | None = None, loss: PolicyLoss | None = None, train: bool = False
                   ) -> RowInputs:
        """A request's per-row inputs for this tenant's head, checked on the host (checking a device
        tensor would wait for the device): the state (None where the head reads none), and for a
        forward_backward (`train`) the actions, the step mask (all steps by default) and the RL objective."""
        if train and self.optimizer is None:
            raise InvalidInputError(f"tenant {self.tenant!r}: this slot is a serving copy (no optimizer); "
                                    f"forward_backward runs on the training service")
        return check_rows(self.tenant, self.head_spec, self.head, batch, state, actions, action_mask, loss, train)

    def _check_feature(self, feature: VLAFeature) -> VLAFeature:
        if feature.meta.backbone_id != self.backbone_id:
            raise IncompatibleError(f"tenant {self.tenant!r} is bound to backbone {self.backbone_id!r}, "
                                    f"got features of {feature.meta.backbone_id!r}")
        if torch.is_autocast_enabled(self.device.type):
            return feature  # autocast casts at each matmul
        return feature.to(self.head.step_pos.dtype)

    def _normal_state(self, rows: RowInputs) -> Tensor | None:
        if rows.state is None:
            return None
        return self.stats["state"].normalize(to_device(rows.state, self.device, torch.float32))

    def fb_inputs(self, feature: VLAFeature, rows: RowInputs) -> FBInputs:
        """Checked rows (`check_rows`) with the request's features, normalised, on the device."""
        feature = self._check_feature(feature)
        actions = self.stats["action"].normalize(to_device(rows.actions, self.device, torch.float32))
        return FBInputs(feature, self._normal_state(rows), actions, to_device(rows.mask, self.device),
                        None if rows.loss is None else rows.loss.to(self.device))

    def sample_inputs(self, feature: VLAFeature, rows: RowInputs) -> tuple[VLAFeature, Tensor | None]:
        return self._check_feature(feature), self._normal_state(rows)

    def draw(self, purpose: str, batch: int, deterministic: bool = False, explore=None) -> dict[str, Tensor]:
        """This call's random draws from the tenant's generator, on the slot's device. `explore`: a
        `FlowExploration` (a flow policy sampling for RL)."""
        if explore is None:
            return host_noise(self.head.draw(purpose, batch, self.generator, deterministic), self.device)
        if not getattr(self.head, "EXPLORES", False):
            raise InvalidInputError(f"explore: the {self.head_spec.kind} head of tenant {self.tenant!r} samples "
                                    f"for RL as it is; flow exploration is for flow heads")
        return host_noise(self.head.draw(purpose, batch, self.generator, deterministic, explore=explore), self.device)

    # ---- operations ---------------------------------------------------------------------------
    def objective(self, x: FBInputs, head_out) -> tuple[Tensor, dict, dict]:
        """The loss, metrics and extras of one tenant, from its head's output: the supervised
        (loss, metrics) of `head.loss`, or the (log_prob, entropy, value) of `head.evaluate` for RL."""
        if x.loss is None:
            loss, metrics = head_out
            return loss, metrics, {}
        log_prob, entropy, value = head_out
        loss, metrics = policy_objective(log_prob, entropy, value, x.loss)
        return loss, metrics, {"log_prob": log_prob.detach()}

    def head_forward(self, x: FBInputs, noise: dict):
        if x.loss is None:
            return self.head.loss(x.feature, x.state, x.actions, x.mask, noise=noise)
        return self.head.evaluate(x.feature, x.state, x.actions, x.mask, sampled=x.loss.sampled)

    def compute(self, x: FBInputs, noise: dict | None = None) -> PendingGrads:
        """This tenant's gradients on `x`, not applied (see `PendingGrads`); nothing waits for the device.
        `noise`: the loss's draws as given, else drawn from the tenant's generator."""
        rng = self.generator.get_state()
        try:
            if noise is not None:
                noise = host_noise(noise, self.device)
            elif x.loss is None:
                noise = self.draw("loss", x.feature.batch_size)
            else:
                noise = {}
            loss, metrics, extra = self.objective(x, self.head_forward(x, noise))
            params = self.params
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        except BaseException:
            self.generator.set_state(rng)
            raise
        return self.pending(loss, metrics, extra, list(grads), rng)

    @staticmethod
    def pending(loss: Tensor, metrics: dict, extra: dict, grads: list, rng: Tensor) -> PendingGrads:
        present = [g for g in grads if g is not None]
        finite, norm = torch.isfinite(loss.detach()), None
        if present:
            # the norm clip_grad_norm_ would take (non-finite where an entry is, or where it overflows:
            # no step could use that gradient either); kept for the step's clipping
            norm = torch.nn.utils.get_total_norm(present)
            finite = finite & norm.isfinite()
        return PendingGrads(grads, {"loss": loss.detach(), **metrics, **extra}, finite, rng, norm)

    def settle(self, pending: PendingGrads, finite: bool, out: dict) -> dict:
        """Apply a computed forward_backward (`finite`, `out`: its flag and outputs, read on the host),
        or drop it with NonFiniteError, leaving the slot as it was."""
        if not finite:
            self.generator.set_state(pending.rng)
            loss = float(out["loss"])
            what = f"loss is {loss}" if not math.isfinite(loss) else "gradient has NaN or infinite values"
            raise NonFiniteError(f"tenant {self.tenant!r}: {what}")
        held, adds = [], []
        for p, g in zip(self.params, pending.grads):
            if g is None:
                continue
            if p.grad is None:
                # dense: torch's fused AdamW (2.13, CPU) reads a strided gradient as if it were dense
                p.grad = g if g.is_contiguous() else g.contiguous()
            else:
                held.append(p.grad)
                adds.append(g)
        if held:  # accumulating over micro-batches: one call for all the head's parameters
            torch._foreach_add_(held, adds)
        self._grad_norm = pending.norm if self.accumulated == 0 else None  # a sum's norm is not known
        self.accumulated += 1
        return {k: float(v) if isinstance(v, Tensor) and v.dim() == 0 else v for k, v in out.items()}

    def forward_backward(self, feature: VLAFeature, state: Tensor | None, actions: Tensor,
                         action_mask: Tensor | None = None, loss: PolicyLoss | None = None) -> dict:
        """Add this batch's gradients to the slot; returns the loss and head metrics. Without `loss`
        the head's supervised loss on `actions`; with it, the RL objective (then also the rows'
        current `log_prob`, a proximal policy for later epochs over the same batch). Direct use
        waits for the device; the model runner batches that wait over a group (`compute`/`settle`)."""
        rows = self.check_rows(feature.batch_size, state, actions, action_mask, loss, train=True)
        pending = self.compute(self.fb_inputs(feature, rows))
        finite, out = to_cpu((pending.finite, pending.out))
        return self.settle(pending, bool(finite), out)

    def optim_step(self) -> dict:
        """Apply accumulated gradients; the policy version increases by one. grad_norm is a 0-d tensor
        (on the device: reading it is the caller's wait)."""
        if self.accumulated == 0:
            raise InvalidInputError(f"optim_step: tenant {self.tenant!r} has no gradients since its last step")
        params = [p for p in self.params if p.grad is not None]
        clip = self.optim_spec.grad_clip
        # clip_grad_norm_ in its two halves, the norm reused when one forward_backward computed it
        norm = self._grad_norm if self._grad_norm is not None else \
            torch.nn.utils.get_total_norm([p.grad for p in params])
        if clip is not None:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        self.optimizer.step()
        if self.optimizer.param_groups[0].get("fused"):
            # the fused kernel writes the parameters without moving their version counters, by which
            # the stacked heads (vlamux.model.fused) see that a tenant's parameters changed
            torch.autograd.graph.increment_version(params)
        self.drop_gradients()
        self.version += 1
        return {"grad_norm": norm.detach(), "policy_version": self.version}

    def finish_sample(self, out: dict) -> dict:
        """A head's sample output in the tenant's own units, stamped with the policy version."""
        out["actions"] = self.stats["action"].unnormalize(out["actions"])
        out["policy_version"] = self.version
        return out

    def sample(self, feature: VLAFeature, state: Tensor | None, deterministic: bool = False, explore=None) -> dict:
        """An action chunk in the tenant's own units, stamped with the policy version (device tensors)."""
        return self.sample_rows(feature, self.check_rows(feature.batch_size, state), deterministic, explore=explore)

    @torch.no_grad()
    def sample_rows(self, feature: VLAFeature, rows: RowInputs, deterministic: bool = False,
                    noise: dict | None = None, explore=None) -> dict:
        """`sample` on checked rows (`check_rows`); `noise`: the call's draws as given (a caller that fixes
        them, e.g. to compare with a reference), else drawn from the tenant's generator (`explore`: a
        flow policy's exploration for RL)."""
        feature, state_n = self.sample_inputs(feature, rows)
        rng = self.generator.get_state()
        try:
            if noise is None:
                noise = self.draw("sample", feature.batch_size, deterministic, explore)
            elif explore is not None:  # the starting noise given; the chain's own noise drawn as usual
                noise = {**self.draw("sample", feature.batch_size, deterministic, explore),
                         **host_noise(noise, self.device)}
            else:
                noise = host_noise(noise, self.device)
            return self.finish_sample(self.head.sample(feature, state_n, deterministic=deterministic, noise=noise))
        except BaseException:
            self.generator.set_state(rng)
            raise

    # ---- control plane: policy snapshots ----------------------------------------------------
    def policy_tensors(self) -> dict[str, Tensor]:
        """The serving part of this slot (head and adapter weights, statistics), as the slot holds them."""
        tensors = dict(self.module_state())
        for name, stats in self.stats.items():
            tensors.update({f"stats.{name}.{f}": getattr(stats, f) for f in ("mean", "std", "min", "max")})
        return tensors

    def export_policy(self, export=None) -> PolicySnapshot:
        """This slot's policy version as a snapshot: what inference replicas need. `export` makes the
        host copies (a `Lane.export`: asynchronous on CUDA); by default plain copies."""
        tensors, done = (export or _plain_export)(self.policy_tensors())
        return PolicySnapshot(self.tenant, self.version, self.backbone_id, self.head_spec, tensors,
                              {k: v.mode for k, v in self.stats.items()}, done)

    def apply_policy(self, snap: PolicySnapshot) -> None:
        """Serve `snap` from now on. The copies into the device are asynchronous (call it inside the
        replica lane's `importing(snap.done)` block on CUDA); host state changes at once."""
        if snap.tenant != self.tenant or snap.head_spec != self.head_spec or snap.backbone_id != self.backbone_id:
            raise IncompatibleError(f"policy snapshot of tenant {snap.tenant!r} ({snap.head_spec.kind}) does not fit "
                                    f"the slot of tenant {self.tenant!r} ({self.head_spec.kind})")
        own = self.module_state()
        given = {k: v for k, v in snap.tensors.items() if k.startswith(MODULE_PREFIXES)}
        if given.keys() != own.keys() or any(given[k].shape != own[k].shape for k in own):
            raise IncompatibleError(f"policy snapshot of tenant {snap.tenant!r}: its module's tensors do not match")
        with torch.no_grad():
            for k, dst in own.items():
                copy_into(dst, given[k])
        self.stats = {k: NormStats.placed(snap.tensors, f"stats.{k}", m, self.device)
                      for k, m in snap.stats_modes.items()}
        self.version = snap.version

    @classmethod
    def from_policy(cls, snap: PolicySnapshot, feature_meta: FeatureMeta, device="cpu", **backbone) -> Slot:
        slot = cls(snap.tenant, snap.head_spec, feature_meta, device=device, **backbone)
        slot.apply_policy(snap)
        return slot

    def memory_bytes(self) -> dict[str, int]:
        """What this tenant costs in memory: its head, its adapter, its optimizer state."""
        def size(ts):
            return sum(t.numel() * t.element_size() for t in ts)

        states = self.optimizer.state.values() if self.optimizer is not None else ()
        optim = [v for st in states for v in st.values() if isinstance(v, Tensor)]
        return {"head": size(self.head.parameters()),
                "adapter": size(self.adapter.parameters()) if self.adapter is not None else 0,
                "queries": size(self.queries.parameters()) if self.queries is not None else 0,
                "optimizer": size(optim)}

    # ---- adapters in PEFT's layout ---------------------------------------------------------------------
    def export_adapter(self, out: str | Path, base_model: str | None = None) -> Path:
        """This tenant's adapter as a PEFT directory (`peft.PeftModel.from_pretrained(base, out)` on the
        same base model reproduces its features)."""
        from vlamux.model.adapters import export_peft

        if self.adapter is None:
            raise InvalidInputError(f"export_adapter: tenant {self.tenant!r}'s head has no adapter")
        export_peft(self.adapter, out, base_model)
        return Path(out)

    def import_adapter(self, path: str | Path) -> None:
        """Start from a PEFT LoRA directory's weights: its rank, alpha and adapted Linears must be this
        slot's (make the slot's spec from it: `adapter_spec_of`). The version moves on by one."""
        from vlamux.model.adapters import read_peft

        if self.adapter is None:
            raise InvalidInputError(f"import_adapter: tenant {self.tenant!r}'s head has no adapter")
        spec, tensors = read_peft(path)
        mine = self.adapter.spec
        if (spec.rank, spec.alpha) != (mine.rank, mine.alpha):
            raise IncompatibleError(f"{path}: rank {spec.rank}, alpha {spec.alpha}; the slot's adapter has rank "
                                    f"{mine.rank}, alpha {mine.alpha}")
        theirs = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in tensors if ".lora_" in k}
        extra = sorted(theirs - set(self.adapter.targets))
        if extra:
            raise IncompatibleError(f"{path}: adapts Linears the slot's adapter does not: {extra[:4]}"
                                    f"{' ...' if len(extra) > 4 else ''}")
        self.adapter.load_peft_state_dict(tensors)
        self.version += 1

    # ---- persistence (the file format: vlamux.model.slot_file) ---------------------------------
    def state_tensors(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        """Everything of this tenant, as safetensors tensors + metadata."""
        return slot_file.state_tensors(self)

    def save(self, path: str | Path) -> None:
        slot_file.save(self, path)

    def load_state(self, path: str | Path) -> None:
        """Restore this tenant's state from a file it saved; refuses another tenant's or head's file;
        a refused or broken load leaves the slot as it was."""
        slot_file.load(self, path)

    def newer_than(self, published: int) -> None:
        """After loading a checkpoint, move past the newest version already published: a policy
        version names one set of weights, forever, so a rollback gets a new number."""
        if self.version <= published:
            self.version = published + 1

    def drop_gradients(self) -> None:
        """No gradients held: after an optimizer step, or a restored state."""
        for p in self._module_params():
            p.grad = None
        self.accumulated, self._grad_norm = 0, None

    @classmethod
    def from_file(cls, path: str | Path, feature_meta: FeatureMeta, device="cpu", **backbone) -> Slot:
        _, meta = slot_file.read_slot_file(path)
        opt = json.loads(meta["optim_spec"])
        slot = cls(meta["tenant"], HeadSpec.from_json(meta["head_spec"]), feature_meta, OptimizerSpec(**opt),
                   seed=int(meta["seed"]), device=device, **backbone)
        slot.load_state(path)
        return slot


def _placed(make, device: torch.device, init: bool) -> torch.nn.Module:
    """`make()`'s module on `device`: initialised, or (init=False) built on the meta device and given
    uninitialised storage there, for a state about to be copied in."""
    if init:
        return make().to(device)
    with torch.device("meta"):
        module = make()
    return module.to_empty(device=device)


def _plain_export(tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], None]:
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}, None
