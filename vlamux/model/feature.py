"""`VLAFeature`: the backbone's output contract, all an action head may read.

Layout of the token axis, for the built-in backbone:
``[query tokens][camera 0 patches]...[camera K-1 patches][instruction tokens]``.
Camera and text segments may be padded (mask False); `select` trims a
feature back to one request's own cameras and instruction length, which is
what makes group batching invisible to the heads. A VLM backbone keeps its
prompt's own order (chat roles, images, instruction); `token_type` says what
each token is, and heads read only types and masks, never positions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum

import torch
from torch import Tensor


class TokenType(IntEnum):
    """Values of `VLAFeature.token_type`; camera k has type ``CAMERA + k``."""

    PROMPT = -1  # a VLM prompt's own tokens around the inputs: chat roles, image delimiters, system text
    TEXT = 0
    QUERY = 1
    CAMERA = 2


@dataclass(frozen=True)
class FeatureMeta:
    backbone_id: str
    hidden_dim: int
    n_layers: int
    n_query: int
    patches_per_camera: int


@dataclass
class VLAFeature:
    hidden: Tensor  # [B, L, D] final (normed) hidden states
    mask: Tensor  # [B, L] bool, True where a token is real
    token_type: Tensor  # [B, L] int64, see TokenType
    meta: FeatureMeta
    layers: tuple[Tensor, ...] = ()  # hidden states of the last k blocks, oldest first, each [B, L, D]
    # A LeRobot backbone's prefix: each language layer's keys (after RoPE) and values and the prefix's
    # real tokens (vlamux.model.vla.vlm.PrefixKV), what an imported expert reads at every flow step
    kv: object | None = None

    @property
    def batch_size(self) -> int:
        return self.hidden.shape[0]

    @property
    def seq_len(self) -> int:
        return self.hidden.shape[1]

    def to(self, dtype: torch.dtype) -> VLAFeature:
        """The same feature in `dtype` (a head may run in another precision than the backbone)."""
        if self.hidden.dtype == dtype:
            return self
        return replace(self, hidden=self.hidden.to(dtype), layers=tuple(t.to(dtype) for t in self.layers),
                       kv=None if self.kv is None else self.kv.to(dtype))

    def select(self, rows: slice, index: Tensor | None = None, n_layers: int | None = None) -> VLAFeature:
        """Rows `rows`, token positions `index` (all if None), the last `n_layers` layers."""

        def take(t: Tensor) -> Tensor:
            t = t[rows]
            return t if index is None else t.index_select(1, index)

        if self.kv is not None and index is not None:
            raise ValueError("a feature with a prefix's keys and values is selected by rows only")
        if n_layers is not None and n_layers > len(self.layers):
            raise ValueError(f"asked for the last {n_layers} layers, the feature carries {len(self.layers)}")
        layers = self.layers if n_layers is None else (self.layers[len(self.layers) - n_layers:] if n_layers else ())
        return replace(
            self,
            hidden=take(self.hidden),
            mask=take(self.mask),
            token_type=take(self.token_type),
            layers=tuple(take(x) for x in layers),
            kv=None if self.kv is None else self.kv.select(rows),
        )


def token_index(n_query: int, patches: int, n_cams: int, text_len: int, group_cams: int, device=None) -> Tensor:
    """Positions of one request's tokens inside a group's token axis."""
    head = torch.arange(n_query + n_cams * patches, device=device)
    text_start = n_query + group_cams * patches
    text = torch.arange(text_start, text_start + text_len, device=device)
    return torch.cat([head, text])
