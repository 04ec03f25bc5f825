"""Per-tenant LoRA adapters on the shared backbone, applied in mixed-tenant groups.

A LoRA is a function applied to a backbone's Linear layers, not a fork of the model: `install`
puts one forward hook on each Linear a tenant may adapt. While a group runs, `active(segments)` says,
for the group's layout along the layers' leading dimension (the built-in backbone's packed tokens, a
VLM's rows), which segment belongs to which tenant's adapter; each hooked Linear then adds each
tenant's low-rank delta ``scale * B(A x)`` to that tenant's segment only (Punica's segment form).
The frozen base weights run once over every row; a segment with no adapter is left exactly as the
base computed it. The context is per thread: the training and inference services share a backbone.

An adapter belongs to its tenant's slot (`LoRAAdapter`, one optimizer over head and adapter) and is
saved, published and exported with it; `peft_state_dict`/`from_peft` speak PEFT's layout.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from vlamux.errors import InvalidInputError


@dataclass(frozen=True)
class LoRASpec:
    """A head spec's ``adapter: {kind: lora, rank, alpha, dropout, target_modules, layers}``."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None  # Linear names (their last component); None: the backbone's
    layers: tuple[int, ...] | None = None  # which blocks (None: all)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @staticmethod
    def from_dict(d: Any, where: str = "adapter") -> LoRASpec:
        if not isinstance(d, dict):
            raise InvalidInputError(f"{where}: expected a mapping, got {type(d).__name__}")
        unknown = set(d) - {"kind", "rank", "alpha", "dropout", "target_modules", "layers"}
        if unknown:
            raise InvalidInputError(f"{where}.{sorted(unknown)[0]}: unknown field; allowed: kind, rank, alpha, "
                                    f"dropout, target_modules, layers")
        if d.get("kind", "lora") != "lora":
            raise InvalidInputError(f"{where}.kind: only 'lora' adapters exist, got {d.get('kind')!r}")
        rank, alpha, dropout = d.get("rank", 8), d.get("alpha", 16.0), d.get("dropout", 0.0)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 1024:
            raise InvalidInputError(f"{where}.rank: an integer in [1, 1024], got {rank!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            raise InvalidInputError(f"{where}.alpha: a positive number, got {alpha!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise InvalidInputError(f"{where}.dropout: a number in [0, 1), got {dropout!r}")
        if dropout:  # a per-tenant, reproducible dropout stream in mixed groups is not built yet
            raise InvalidInputError(f"{where}.dropout: only 0 is supported so far, got {dropout!r}")
        targets, layers = d.get("target_modules"), d.get("layers")
        if targets is not None and (not isinstance(targets, (list, tuple)) or not targets
                                    or not all(isinstance(t, str) and t for t in targets)):
            raise InvalidInputError(f"{where}.target_modules: a non-empty list of module names, got {targets!r}")
        if layers is not None and (not isinstance(layers, (list, tuple)) or not layers or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
            raise InvalidInputError(f"{where}.layers: a non-empty list of block indices, got {layers!r}")
        return LoRASpec(rank, float(alpha), float(dropout), tuple(targets) if targets else None,
                        tuple(layers) if layers else None)

    def to_dict(self) -> dict:
        return {"kind": "lora", **asdict(self)}


@dataclass(frozen=True)
class Target:
    """A Linear a tenant may adapt: its name in the backbone, shape and block index."""

    name: str
    in_features: int
    out_features: int
    layer: int


def select_targets(available: dict[str, Target], spec: LoRASpec, default: tuple[str, ...]) -> dict[str, Target]:
    """The Linears `spec` adapts: a target names a Linear by the end of its name ("qkv", "mlp.0",
    "q_proj", "self_attn.q_proj", as PEFT's target_modules do), in the blocks `spec.layers` picks."""
    wanted = spec.target_modules or default

    def matches(name: str, t: str) -> bool:
        return name == t or name.endswith("." + t)

    missing = [t for t in wanted if not any(matches(n, t) for n in available)]
    if missing:
        local = sorted({n.split(f".{t.layer}.", 1)[-1] for n, t in available.items()})
        raise InvalidInputError(f"adapter.target_modules: {missing} name no Linear of this backbone; its blocks "
                                f"have {local}")
    chosen = {n: t for n, t in available.items() if any(matches(n, w) for w in wanted)
              and (spec.layers is None or t.layer in spec.layers)}
    if not chosen:
        raise InvalidInputError(f"adapter.layers: {list(spec.layers or ())} select no block of this backbone "
                                f"(blocks 0..{max(t.layer for t in available.values())})")
    return chosen


def _key(name: str) -> str:
    return name.replace(".", "__")  # module names carry dots; parameter keys may not


class LoRAAdapter(nn.Module):
    """A tenant's low-rank deltas: for each adapted Linear, A [r, in] (Kaiming) and B [out, r] (zeros,
    so a new adapter changes nothing until it is trained), as PEFT initialises them."""

    def __init__(self, spec: LoRASpec, targets: dict[str, Target]):
        super().__init__()
        self.spec, self.targets = spec, targets
        self.A = nn.ParameterDict()
        self.B = nn.ParameterDict()
        for name, t in targets.items():
            a = torch.empty(spec.rank, t.in_features)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            self.A[_key(name)] = nn.Parameter(a)
            self.B[_key(name)] = nn.Parameter(torch.zeros(t.out_features, spec.rank))

    def adapts(self, name: str) -> bool:
        return name in self.targets

    def delta(self, name: str, x: Tensor) -> Tensor:
        """``scale * B(A x)`` in x's dtype (the weights cast to it; their gradients reach the fp32 masters)."""
        k = _key(name)
        a, b = self.A[k].to(x.dtype), self.B[k].to(x.dtype)
        return (x @ a.t()) @ b.t() * self.spec.scale

    # ---- PEFT's layout ------------------------------------------------------------------------------
    def peft_state_dict(self, prefix: str = "") -> dict[str, Tensor]:
        """PEFT's key names (`base_model.model.<module>.lora_A.weight`) for a base model whose modules
        are named `prefix + name`."""
        out = {}
        for name in self.targets:
            k = _key(name)
            out[f"base_model.model.{prefix}{name}.lora_A.weight"] = self.A[k].detach().cpu().contiguous()
            out[f"base_model.model.{prefix}{name}.lora_B.weight"] = self.B[k].detach().cpu().contiguous()
        return out

    def load_peft_state_dict(self, tensors: dict[str, Tensor], prefix: str = "") -> None:
        """Take a PEFT adapter's weights (an import); every adapted Linear must be in it, shapes equal."""
        for name in self.targets:
            k = _key(name)
            for part, mine in (("lora_A", self.A[k]), ("lora_B", self.B[k])):
                key = f"base_model.model.{prefix}{name}.{part}.weight"
                if key not in tensors:
                    raise InvalidInputError(f"adapter import: {key} is missing from the PEFT adapter")
                if tuple(tensors[key].shape) != tuple(mine.shape):
                    raise InvalidInputError(f"adapter import: {key} is {list(tensors[key].shape)}, the slot's is "
                                            f"{list(mine.shape)}")
        with torch.no_grad():
            for name in self.targets:
                k = _key(name)
                self.A[k].copy_(tensors[f"base_model.model.{prefix}{name}.lora_A.weight"])
                self.B[k].copy_(tensors[f"base_model.model.{prefix}{name}.lora_B.weight"])


# ---- mixed groups: the hooks and their per-thread context -------------------------------------------
_ACTIVE = threading.local()


class active:
    """While a group's backbone forward runs on this thread: `segments` are (length, adapter or None)
    along the adapted Linears' leading dimension, in order."""

    def __init__(self, segments: list[tuple[int, LoRAAdapter | None]]):
        self.segments = segments if any(a is not None for _, a in segments) else None

    def __enter__(self):
        self.previous = getattr(_ACTIVE, "segments", None)
        _ACTIVE.segments = self.segments
        return self

    def __exit__(self, *exc):
        _ACTIVE.segments = self.previous


def install(backbone) -> None:
    """Hook every Linear of `backbone` a tenant may adapt (once: a backbone is shared by all)."""
    if getattr(backbone, "_lora_hooks", None) is not None:
        return
    hooks = []
    for name, target in backbone.adaptable().items():
        module = backbone.get_submodule(name)
        hooks.append(module.register_forward_hook(_hook(name)))
    backbone._lora_hooks = hooks


def _hook(name: str):
    def hook(module, inputs, output):
        segments = getattr(_ACTIVE, "segments", None)
        if segments is None or not any(a is not None and a.adapts(name) for _, a in segments):
            return output
        x = inputs[0]
        sizes = [n for n, _ in segments]
        if sum(sizes) != x.shape[0]:
            raise RuntimeError(f"LoRA segments cover {sum(sizes)} of {x.shape[0]} rows at {name}")
        adapters = [a if a is not None and a.adapts(name) else None for _, a in segments]
        if (len(adapters) > 1 and None not in adapters and len({a.spec.rank for a in adapters}) == 1
                and len(set(sizes)) == 1):
            return _uniform_group(name, x, output, adapters)
        return _segmented(name, x, output, sizes, adapters)

    return hook


def _uniform_group(name: str, x: Tensor, output: Tensor, adapters: list[LoRAAdapter]) -> Tensor:
    """Every segment adapted, all of one length and one rank: the input and the output seen as [N, rows,
    features] are views, so the deltas take two batched matmuls (Punica's SGMV case), the second one
    adding onto the base output, with no copy of the activations. They run in the activations' dtype
    (bf16 on a GPU) on the tenants' fp32 weights cast to it, so the weights' gradients come back in fp32.
    Each tenant's rows meet only its own A and B: a NaN stays in its batch entry."""
    k, dt = _key(name), output.dtype
    scales = {ad.spec.scale for ad in adapters}
    a = torch.stack([ad.A[k] for ad in adapters]).to(dt)  # [N, r, in]
    if len(scales) == 1:
        b, scale = torch.stack([ad.B[k] for ad in adapters]).to(dt), scales.pop()  # [N, out, r]
    else:  # scaled on the device: no host tensor of scales to copy over per layer
        b, scale = torch.stack([ad.B[k] * ad.spec.scale for ad in adapters]).to(dt), 1.0
    n = len(adapters)
    h = torch.bmm(x.reshape(n, -1, x.shape[-1]).to(dt), a.transpose(1, 2))
    return torch.baddbmm(output.reshape(n, -1, output.shape[-1]), h, b.transpose(1, 2), alpha=scale).view(output.shape)


def _segmented(name: str, x: Tensor, output: Tensor, sizes: list[int], adapters: list) -> Tensor:
    """Segments of any lengths and ranks, some with no adapter: each adapted segment's delta is added
    in place onto its own rows of the base output (mLoRA's per-segment add)."""
    k = _key(name)
    per_row = x[0].numel() // x.shape[-1] if x.shape[0] else 1  # 2-D rows per leading index
    spans, weights = [], []
    start = 0
    for n, ad in zip(sizes, adapters):
        if ad is not None:
            spans.append((start * per_row, n * per_row, ad.spec.scale))
            weights += [ad.A[k], ad.B[k]]
        start += n
    return _SegmentedLoRA.apply(x, output, spans, *weights)


class _SegmentedLoRA(torch.autograd.Function):
    """`output` (the Linear's own result, which its backward does not keep) plus each span's delta, in
    place, the gradient to `output` passing through unchanged: slicing a tensor inside autograd would
    make each slice's backward fill a group-size zero tensor per segment and layer, and a concatenation
    would copy every activation. Forward and backward touch each span's rows only, with its own A and
    B, so a NaN adapter stays in its rows. The deltas run in the output's dtype (bf16 on a GPU: no fp32
    copy of the activations) on the fp32 weights cast to it; the weights' gradients are returned in
    fp32, the masters' dtype."""

    @staticmethod
    def forward(ctx, x, output, spans, *weights):
        # in place through a detached alias: `output` may be a view (a Linear on [B, S, in] views its
        # matmul's result), and a view marked dirty would route its gradient through its base
        dt = output.dtype
        x2, o2 = x.reshape(-1, x.shape[-1]), output.detach().view(-1, output.shape[-1])
        hs = []
        for (start, n, scale), a, b in zip(spans, weights[0::2], weights[1::2]):
            h = x2[start:start + n].to(dt) @ a.to(dt).t()
            o2[start:start + n].addmm_(h, b.to(dt).t(), alpha=scale)
            hs.append(h)
        ctx.spans = spans
        ctx.save_for_backward(x, *hs, *weights)
        return output

    @staticmethod
    def backward(ctx, grad):
        x, *rest = ctx.saved_tensors
        hs, weights = rest[:len(ctx.spans)], rest[len(ctx.spans):]
        dt = hs[0].dtype if hs else grad.dtype
        x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        gx = _rows_zero_outside(x2, ctx.spans) if ctx.needs_input_grad[0] else None
        grads = []
        for i, ((start, n, scale), h) in enumerate(zip(ctx.spans, hs)):
            a, b = weights[2 * i], weights[2 * i + 1]
            g = g2[start:start + n].to(dt)
            u = g @ b.to(dt)  # [n, r]
            if gx is not None:
                gx[start:start + n] = (u @ a.to(dt)).mul_(scale).to(gx.dtype)
            grads += [(u.t() @ x2[start:start + n].to(dt)).to(a.dtype).mul_(scale)
                      if ctx.needs_input_grad[3 + 2 * i] else None,
                      (g.t() @ h).to(b.dtype).mul_(scale) if ctx.needs_input_grad[4 + 2 * i] else None]
        return (gx.view(x.shape) if gx is not None else None), grad, None, *grads


def _rows_zero_outside(x2: Tensor, spans: list) -> Tensor:
    """An uninitialised tensor like `x2` whose rows outside every span are zero: the spans' rows are
    written in full by the caller, so only the gaps between them are cleared (none, where the adapted
    segments cover the group)."""
    out = torch.empty_like(x2)
    at = 0
    for start, n, _ in sorted(spans):
        if start > at:
            out[at:start].zero_()
        at = max(at, start + n)
    if at < out.shape[0]:
        out[at:].zero_()
    return out


# ---- PEFT directories -------------------------------------------------------------------------------
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def export_peft(adapter: LoRAAdapter, out, base_model: str | None = None) -> None:
    """`adapter` as PEFT writes one: adapter_config.json + adapter_model.safetensors, its Linears named
    in full, so `peft.PeftModel.from_pretrained(base, out)` adapts exactly those on the same base."""
    import json
    from pathlib import Path

    from vlamux.utils.io import atomic_save_safetensors

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = adapter.spec
    config = {"peft_type": "LORA", "task_type": None, "r": spec.rank, "lora_alpha": spec.alpha,
              "lora_dropout": spec.dropout, "target_modules": sorted(adapter.targets), "bias": "none",
              "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "use_rslora": False,
              "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
              "base_model_name_or_path": base_model, "revision": None}
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2))
    atomic_save_safetensors(adapter.peft_state_dict(), out / PEFT_WEIGHTS, {"format": "pt"})


def read_peft(path) -> tuple[LoRASpec, dict[str, Tensor]]:
    """A PEFT LoRA directory: the spec it describes (its target_modules as they are named there) and its
    tensors. Errors name the file and the field."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(path)
    cfg_path, weights = path / PEFT_CONFIG, path / PEFT_WEIGHTS
    for f in (cfg_path, weights):
        if not f.is_file():
            raise InvalidInputError(f"{f}: missing (a PEFT adapter directory holds {PEFT_CONFIG} and {PEFT_WEIGHTS})")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidInputError(f"{cfg_path}: not readable JSON ({e})") from None
    if cfg.get("peft_type") != "LORA":
        raise InvalidInputError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}: only LORA adapters import")
    for field_, unsupported in (("use_dora", True), ("use_rslora", True), ("fan_in_fan_out", True)):
        if cfg.get(field_) == unsupported:
            raise InvalidInputError(f"{cfg_path}: {field_}=true is not supported")
    if cfg.get("bias", "none") != "none":
        raise InvalidInputError(f"{cfg_path}: bias={cfg['bias']!r}: only bias='none' adapters import")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise InvalidInputError(f"{cfg_path}: target_modules must be a list of module names, got {targets!r}")
    spec = LoRASpec.from_dict({"rank": cfg.get("r"), "alpha": cfg.get("lora_alpha", cfg.get("r")),
                               "dropout": cfg.get("lora_dropout", 0.0), "target_modules": list(targets),
                               "layers": cfg.get("layers_to_transform")}, where=str(cfg_path))
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - a broken header raises several kinds
        raise InvalidInputError(f"{weights}: not a readable safetensors file ({e})") from None
    return spec, tensors
