"""The `Backbone` interface: frozen, shared, resident; `CanonicalBatch` in, `VLAFeature` out."""

from __future__ import annotations

import abc

import torch
from torch import nn

from vlamux.model.batch import CanonicalBatch, InputSchema
from vlamux.model.feature import FeatureMeta, VLAFeature, token_index
from vlamux.model.tokenizer import ByteTokenizer


class Backbone(nn.Module, abc.ABC):
    """A frozen feature extractor shared by every tenant of a model service.

    Implementations must not mix rows of a batch (no BatchNorm, no
    batch-dependent dropout) and must ignore masked-out tokens, so a row's
    features do not depend on which other rows share its batch.
    """

    backbone_id: str
    kind: str = "builtin"
    schema: InputSchema
    tokenizer: ByteTokenizer
    prepares_on_device: bool = True  # `prepare` allocates on the device (in a service's rollout pool)

    @property
    @abc.abstractmethod
    def meta(self) -> FeatureMeta: ...

    def prepare(self, obs, n_query: int = 0):
        """A request's observation in this backbone's input form, checked (on the host) and on its
        device: here the canonical batch; a VLM backbone runs its family's processor instead (and
        appends `n_query` placeholders for a tenant's query tokens)."""
        from vlamux.model.batch import canonicalize

        if n_query:
            raise ValueError(f"backbone {self.backbone_id!r} takes no tenant query tokens")
        return canonicalize(obs, self.schema, self.tokenizer, self.device, self.dtype)

    @abc.abstractmethod
    def forward(self, batch: CanonicalBatch, n_layers: int = 0) -> VLAFeature:
        """Features of `batch`; `n_layers` > 0 also returns the last n blocks' hidden states."""

    def forward_group(self, batches: list[CanonicalBatch], n_layers: int = 0) -> list[VLAFeature]:
        """Features of several requests' batches from one backbone pass, one `VLAFeature` per batch,
        each shaped as if its batch had run alone.

        This default pads the batches to one (masked), runs `forward` once and trims each request's
        features back to its own cameras and instruction length. Backbones that can skip the padding
        (the built-in one packs tokens) override it.
        """
        if len(batches) == 1:
            return [self(batches[0], n_layers=n_layers)]
        group = CanonicalBatch.concat(batches)
        feature = self(group, n_layers=n_layers)
        m, out, start = feature.meta, [], 0
        for b in batches:
            index = None
            if b.n_cameras != group.n_cameras or b.text_len != group.text_len:
                index = token_index(m.n_query, m.patches_per_camera, b.n_cameras, b.text_len, group.n_cameras,
                                    feature.hidden.device)
            out.append(feature.select(slice(start, start + b.batch_size), index))
            start += b.batch_size
        return out

    # ---- what tenants' adapters may change (vlamux.model.adapters) --------------------------------------
    LORA_DEFAULT: tuple[str, ...] = ()  # the Linears an adapter adapts when its spec names none

    def adaptable(self) -> dict:
        """{module name: Target} of every Linear a tenant's LoRA may adapt; none by default."""
        return {}

    def segments(self, batches: list) -> list[int]:
        """Each request's extent along the adapted Linears' leading dimension in a group of `batches`."""
        raise NotImplementedError(f"{type(self).__name__} does not host adapters")

    def query_init(self) -> dict | None:
        """How a tenant's query tokens are made ({dim, std}), or None where they cannot be appended
        (the built-in backbone has its own, shared ones)."""
        return None

    def install_tenant_hooks(self) -> None:
        """The hooks through which a group applies its tenants' own parts inside the shared backbone
        (adapters; a VLM's query tokens). Installed once, before any lane runs, and idempotent: what
        a hook applies is the calling thread's (`vlamux.model.adapters.active`), so a new tenant never
        changes a module that another lane is inside."""
        from vlamux.model import adapters

        adapters.install(self)

    def freeze(self) -> Backbone:
        self.eval()
        self.requires_grad_(False)
        self.install_tenant_hooks()
        return self

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def describe(self) -> dict:
        """What a service lists for this backbone (GET /v1/backbones)."""
        m = self.meta
        resident = sum(t.numel() * t.element_size() for t in [*self.parameters(), *self.buffers()])
        return {"id": self.backbone_id, "kind": self.kind, "parameters": self.num_parameters(),
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device), "resident_bytes": resident,
                "hidden_dim": m.hidden_dim, "layers": m.n_layers, "tokens_per_camera": m.patches_per_camera,
                "sha256": getattr(self, "content_sha256", None)}
