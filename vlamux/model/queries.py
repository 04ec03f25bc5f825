"""A tenant's learned query (action) tokens, appended to a VLM backbone's prompt (StarVLA's OFT style).

The tokens are part of the tenant's module, like its head and adapter: Q vectors of the backbone's
hidden size. Each of the tenant's rows carries Q placeholder ids after its prompt
(`HFBackbone.prepare(obs, n_query=Q)`), so the family's own code lays the prompt out, masks it and
numbers its positions (Qwen's M-RoPE included) with the tokens in place; while the group runs, a hook
on the backbone's input embedding puts each tenant's vectors at its own rows' placeholders. The hook
is the embedding's for the backbone's life; what it places belongs to the thread running the group,
so the other lane, inside the same module at the same time, never sees it. Causal attention lets the
tokens read the whole prompt, so their last hidden states are an action readout the tenant trains
through the frozen backbone. Rows of other tenants are left exactly as the embedding computed them.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import Tensor, nn

MAX_QUERY_TOKENS = 256


class QueryTokens(nn.Module):
    """Q learned vectors [Q, D], drawn like the backbone's own token embeddings (`std`): a token the
    model has never seen, at the scale it reads tokens at."""

    def __init__(self, n: int, dim: int, std: float = 0.02):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, dim) * std)

    @property
    def n(self) -> int:
        return self.weight.shape[0]


# The placement of the group running on this thread. The hook lives on the shared embedding for the
# backbone's whole life (installed once, before any lane runs) and reads only the calling thread's
# placement: another lane inside the same module meanwhile sees none of it, and nothing is added to
# or removed from a module another thread may be running.
_PLACED = threading.local()


def install(embedding: nn.Module) -> None:
    """Put the one query-token hook on `embedding` (once: the backbone is shared by every lane)."""
    if getattr(embedding, "_vlamux_query_hook", None) is None:
        embedding._vlamux_query_hook = embedding.register_forward_hook(_hook)


def _hook(module, inputs, output):
    placement = getattr(_PLACED, "value", None)
    if placement is None or placement[0] is not module:
        return output
    _, positions, values = placement
    if output.shape[:2] != positions.shape:
        raise RuntimeError(f"query tokens: placed for {list(positions.shape)} tokens, the embedding made "
                           f"{list(output.shape[:2])}")
    return output.masked_scatter(positions.unsqueeze(-1), values.to(output.dtype))


@contextlib.contextmanager
def placed(embedding: nn.Module, positions: Tensor, values: Tensor):
    """While inside, on this thread only, `embedding`'s output takes `values` [P, D] at `positions` (a
    bool [R, L] mask with P entries, row-major: each row's tokens in order), out of place so gradients
    reach `values`. The embedding must carry the hook (`install`)."""
    if getattr(embedding, "_vlamux_query_hook", None) is None:
        raise RuntimeError("query tokens: the embedding has no query hook (install it before the backbone is "
                           "shared)")
    previous = getattr(_PLACED, "value", None)
    _PLACED.value = (embedding, positions, values)
    try:
        yield
    finally:
        _PLACED.value = previous
