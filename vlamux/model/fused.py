"""Fused heads: the requests of one group whose heads share an architecture run as one call.

On a GPU, eight tiny heads launched one after another cost more kernel launches than the backbone
forward they share; run as one call over stacked parameters, they cost one head's launches. Each
tenant's parameters are stacked into [N, ...] tensors (`StackedHeads`, cached until some tenant's
weights change); the head layers apply stacked weights to stacked rows (vlamux.model.heads.layers),
so the same head code serves one tenant and N. What stays per tenant is everything that is the
tenant's: its rows (padded to the widest request of the bucket, the padding masked out or
dropped), its random draws (made from its own generator, in request order, before the call), its
normalisation statistics, its gradients (each tenant's slice of the stacked gradient), its
optimizer step, its policy version. Requests that cannot fuse (another architecture, or alone)
keep the per-tenant path.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlamux.model.feature import VLAFeature
from vlamux.model.slot import Slot
from vlamux.model.slot_inputs import FBInputs, PendingGrads


def architecture(slot: Slot, mode: str) -> tuple:
    """What must match for two requests' heads to run as one call: the head's structure (its spec
    without initialisation-only options), the backbone it reads, its device and dtype, and the
    call's mode (which outputs and which gradients it produces)."""
    key = getattr(slot, "_fusion_key", None)
    if key is None:  # a slot's spec, backbone and device never change: made once
        head = slot.head
        options = {k: v for k, v in head.options.items() if k not in head.INIT_OPTIONS}
        spec = dataclasses.replace(slot.head_spec, options=options)
        key = slot._fusion_key = (spec.to_json(), slot.backbone_id, str(slot.device), str(head.step_pos.dtype))
    return key + (mode,)


class StackedHeads:
    """N heads of one architecture as one module whose parameters are theirs, stacked [N, ...]."""

    def __init__(self, slots: list[Slot]):
        self.slots = list(slots)
        self.module = copy.deepcopy(slots[0].head)
        self.names = [n for n, p in slots[0].head.named_parameters() if p.requires_grad]
        self.params: list[nn.Parameter] = []
        for name in self.names:
            stacked = nn.Parameter(torch.stack([_param(s, name).detach() for s in slots]))
            *path, leaf = name.split(".")
            owner = self.module.get_submodule(".".join(path)) if path else self.module
            setattr(owner, leaf, stacked)
            self.params.append(stacked)
        self.versions = _versions(slots)
        self._positions: dict[int, list[int | None]] = {}

    def positions(self, slot: Slot) -> list[int | None]:
        """For each of `slot`'s trainable parameters (`Slot.params`), its stacked parameter's index, or
        None where it is not stacked (an adapter's)."""
        # a stack holds fixed slots, and a slot's parameters are the same tensors for its life (loads
        # copy into them): the map is made once per slot, not at every training step
        mine = self._positions.get(id(slot))
        if mine is None:
            at = {id(_param(slot, name)): k for k, name in enumerate(self.names)}
            mine = self._positions[id(slot)] = [at.get(id(p)) for p in slot.params]
        return mine

    def refresh(self, slots: list[Slot]) -> None:
        """Copy the tenants' current weights in, if any changed since the last call."""
        versions = _versions(slots)
        if versions == self.versions:
            return
        with torch.no_grad():
            for name, stacked in zip(self.names, self.params):
                torch.stack([_param(s, name) for s in slots], out=stacked.data)
        self.versions = _versions(slots)


def _param(slot: Slot, name: str) -> Tensor:
    return slot.head.get_parameter(name)


def _versions(slots: list[Slot]) -> tuple:
    # a parameter's version counter moves with every in-place change (optimizer steps, loads)
    return tuple((id(p), p._version) for s in slots for p in s.params)


@dataclass
class Bucket:
    """The stacked inputs of one fused call: N requests' rows padded to `rows`."""

    rows: list[int]  # each request's own row count
    feature: VLAFeature
    state: Tensor | None
    noise: dict


class FusedHeads:
    """The fused calls, with a small cache of stacked parameters per (architecture, tenants)."""

    def __init__(self, max_cached: int = 16):
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple, StackedHeads] = OrderedDict()
        # the engine stacks while a service's slot mover, on its own thread, forgets the slots it parks
        self._lock = threading.Lock()
        self.calls = 0  # fused calls made (a fallback to the per-tenant path does not count)

    def stacked(self, slots: list[Slot]) -> StackedHeads:
        key = tuple(id(s) for s in slots)
        with self._lock:
            heads = self._cache.get(key)
            # an id can be reused by a new slot once an old one is gone: the entry holds its slots and is
            # only taken for the very same ones (another tenant's weights must never be served)
            if heads is None or any(a is not b for a, b in zip(heads.slots, slots)):
                heads = self._cache[key] = StackedHeads(slots)
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
                heads.refresh(slots)
            return heads

    def forget(self, slot: Slot) -> None:
        """Drop every cached stack that holds `slot` (it left the runner)."""
        with self._lock:
            for key in [k for k, h in self._cache.items() if any(s is slot for s in h.slots)]:
                del self._cache[key]

    # ---- sampling ---------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, slots: list[Slot], features: list[VLAFeature], states: list, noises: list[dict],
               deterministic: bool) -> list[dict]:
        """Each request's head output (normalised actions and extras, device tensors, its own rows)."""
        heads = self.stacked(slots)
        b = stack_bucket(features, states, noises)
        out = heads.module.sample(b.feature, b.state, deterministic=deterministic, noise=b.noise)
        self.calls += 1
        return [{k: v[i, :n] for k, v in out.items()} for i, n in enumerate(b.rows)]

    # ---- training ---------------------------------------------------------------------------------
    def objectives(self, slots: list[Slot], inputs: list[FBInputs], noises: list[dict]
                   ) -> tuple[StackedHeads, list[tuple[Tensor, dict, dict]]]:
        """The stacked heads and each request's (loss, metrics, extras), not yet differentiated: the
        stacked parameters are leaves, and so are the features unless they carry a backbone's graph
        (a tenant that trains through it: its gradient then reaches the backbone through its own rows)."""
        heads = self.stacked(slots)
        rl = inputs[0].loss is not None
        b = stack_bucket([x.feature for x in inputs], [x.state for x in inputs], noises)
        rows = max(b.rows)
        actions = torch.stack([_pad_rows(x.actions, rows) for x in inputs])
        # padded rows count for nothing: no valid step
        mask = torch.stack([_pad_rows(x.mask, rows, fill=False) for x in inputs])
        if rl:
            sampled = None
            if inputs[0].loss.sampled is not None:  # a flow policy's chains, stacked like the rows
                sampled = {k: torch.stack([_pad_rows(x.loss.sampled[k], rows) for x in inputs])
                           for k in inputs[0].loss.sampled}
            log_prob, entropy, value = heads.module.evaluate(b.feature, b.state, actions, mask, sampled=sampled)
            per = [slot.objective(x, (log_prob[i, :n], entropy[i, :n], None if value is None else value[i, :n]))
                   for i, (slot, x, n) in enumerate(zip(slots, inputs, b.rows))]
        else:
            loss, metrics = heads.module.loss(b.feature, b.state, actions, mask, noise=b.noise)
            per = [(loss[i], {k: v[i] for k, v in metrics.items()}, {}) for i in range(len(inputs))]
        self.calls += 1
        return heads, per

    def forward_backward(self, slots: list[Slot], inputs: list[FBInputs], noises: list[dict],
                         rngs: list[Tensor]) -> list[PendingGrads]:
        """Each request's loss, metrics and gradients (its slice of the stacked gradients), unapplied."""
        heads, per = self.objectives(slots, inputs, noises)
        losses = torch.stack([p[0] for p in per])
        grads = torch.autograd.grad(losses.sum(), heads.params, allow_unused=True)
        # a stacked weight's gradient comes back transposed (the batched matmul's layout): one copy makes
        # every tenant's slice dense, where a strided slice slows each tenant's optimizer step (π0 small, 8
        # tenants on a CPU thread: their AdamW steps 194 ms on strided slices, 126 ms on dense ones)
        grads = [None if g is None else g.contiguous() for g in grads]
        # every request's finiteness from the stacked tensors at once, not tenant by tenant
        finite = torch.isfinite(losses.detach())
        present = [g for g in grads if g is not None]
        if present:
            # each request's global norm: one pass (isfinite takes four), non-finite where an entry is or
            # where the gradient is so large that its norm overflows (no step could use that one either),
            # and what its step's clipping reuses
            norms = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.reshape(len(g), -1), dim=1)
                                                          for g in present]), dim=0)
            finite = finite & norms.isfinite()
        out = []
        for i, (loss_i, metrics_i, extra_i) in enumerate(per):
            # views of the stacked gradient: disjoint slices, one per request
            mine = [None if g is None else g[i] for g in grads]
            out.append(PendingGrads(mine, {"loss": loss_i.detach(), **metrics_i, **extra_i}, finite[i], rngs[i],
                                    norms[i] if present else None))
        return out


def stack_bucket(features: list[VLAFeature], states: list, noises: list[dict]) -> Bucket:
    """Stack N requests' features [B_i, L_i, D] into [N, B, L, D] (B, L the widest), their states and
    draws likewise. Padded tokens are masked out; padded rows repeat a real row (finite, and their
    outputs are dropped or masked), so nothing padded reaches a tenant's result."""
    rows = [f.batch_size for f in features]
    b, length = max(rows), max(f.seq_len for f in features)
    same = all(f.seq_len == length and f.batch_size == b for f in features)

    def stack(get, fill=0) -> Tensor:
        if same:
            return torch.stack([get(f) for f in features])
        return torch.stack([_pad_rows(_pad_tokens(get(f), length, fill), b) for f in features])

    first = features[0]
    layers = tuple(stack(lambda f, k=k: f.layers[k]) for k in range(len(first.layers)))
    kv = None
    if first.kv is not None:  # an imported expert's prefix keys and values, padded like the tokens
        from vlamux.model.vla.vlm import PrefixKV

        kv = PrefixKV([stack(lambda f, k=k: f.kv.keys[k]) for k in range(len(first.kv.keys))],
                      [stack(lambda f, k=k: f.kv.values[k]) for k in range(len(first.kv.values))],
                      stack(lambda f: f.kv.pad, False))
    feature = VLAFeature(stack(lambda f: f.hidden), stack(lambda f: f.mask, False), stack(lambda f: f.token_type),
                         first.meta, layers, kv=kv)
    state = None if states[0] is None else torch.stack([_pad_rows(s, b) for s in states])
    noise = {k: torch.stack([_pad_rows(n[k], b) for n in noises]) for k in noises[0]}
    return Bucket(rows, feature, state, noise)


def _pad_tokens(t: Tensor, length: int, fill=0) -> Tensor:
    """t [B, L, ...] padded on the token axis to `length`."""
    missing = length - t.shape[1]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 2) + [0, missing]
    if t.dtype == torch.bool:
        return F.pad(t.to(torch.uint8), pad, value=int(fill)).to(torch.bool)
    return F.pad(t, pad, value=fill)


def _pad_rows(t: Tensor, rows: int, fill=None) -> Tensor:
    """t [B, ...] with rows up to `rows`: copies of its last row, or `fill` where given."""
    missing = rows - t.shape[0]
    if missing == 0:
        return t
    if fill is None:
        return torch.cat([t, t[-1:].expand(missing, *t.shape[1:])])
    return torch.cat([t, t.new_full((missing, *t.shape[1:]), fill)])
