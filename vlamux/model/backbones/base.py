"""The `Backbone` interface: frozen, shared, resident; `CanonicalBatch` in, `VLAFeature` out."""

from __future__ import annotations

import abc

import torch
from torch import nn

from vlamux.model.batch import CanonicalBatch, InputSchema
from vlamux.model.feature import FeatureMeta, VLAFeature
from vlamux.model.tokenizer import ByteTokenizer


class Backbone(nn.Module, abc.ABC):
    """A frozen feature extractor shared by every tenant of a model service.

    Implementations must not mix rows of a batch (no BatchNorm, no
    batch-dependent dropout) and must ignore masked-out tokens, so a row's
    features do not depend on which other rows share its batch.
    """

    backbone_id: str
    schema: InputSchema
    tokenizer: ByteTokenizer

    @property
    @abc.abstractmethod
    def meta(self) -> FeatureMeta: ...

    @abc.abstractmethod
    def forward(self, batch: CanonicalBatch, n_layers: int = 0) -> VLAFeature:
        """Features of `batch`; `n_layers` > 0 also returns the last n blocks' hidden states."""

    def freeze(self) -> Backbone:
        self.eval()
        self.requires_grad_(False)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
