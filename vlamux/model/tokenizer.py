"""A download-free byte-level instruction tokenizer.

Every UTF-8 string maps to its bytes shifted past a few special ids, so any
language and any instruction works with no vocabulary file to fetch.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

PAD, BOS, EOS = 0, 1, 2
_OFFSET = 3
VOCAB_SIZE = 256 + _OFFSET


class ByteTokenizer:
    vocab_size = VOCAB_SIZE

    def __init__(self, max_tokens: int):
        if max_tokens < 3:
            raise ValueError(f"max_tokens must be >= 3, got {max_tokens}")
        self.max_tokens = max_tokens
        self._warned = False

    def encode(self, text: str) -> list[int]:
        ids = [BOS] + [b + _OFFSET for b in text.encode("utf-8")] + [EOS]
        if len(ids) > self.max_tokens:
            if not self._warned:
                log.warning("instruction of %d tokens truncated to %d: %r", len(ids), self.max_tokens, text[:60])
                self._warned = True
            ids = ids[: self.max_tokens - 1] + [EOS]
        return ids

    def decode(self, ids) -> str:
        return bytes(i - _OFFSET for i in ids if i >= _OFFSET).decode("utf-8", errors="replace")

    def __call__(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """Token ids [B, T] and mask [B, T], padded to the longest text of the batch."""
        encoded = [self.encode(t) for t in texts]
        width = max(len(e) for e in encoded)
        ids = torch.full((len(texts), width), PAD, dtype=torch.long)
        for row, e in enumerate(encoded):
            ids[row, : len(e)] = torch.tensor(e)
        return ids, ids != PAD
