"""Seeded construction that leaves every global random stream as it was.

Modules are built on the CPU and moved to their device afterwards, so only the CPU generator is
seeded and restored: no CUDA generator is touched and no CUDA context is opened on any GPU (the
old `torch.manual_seed` + `fork_rng(all devices)` opened one on every visible GPU per slot).
"""

from __future__ import annotations

import contextlib
import threading

import torch

# torch's global generator is process-wide: two threads building seeded modules at once would
# interleave their draws (and fork_rng's restores), so seeded construction is serialised.
_LOCK = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int):
    with _LOCK, torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield
