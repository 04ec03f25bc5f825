"""Seeded construction that leaves every global random stream (CPU and CUDA) as it was."""

from __future__ import annotations

import contextlib
import threading

import torch

# torch's global generator is process-wide: two threads building seeded modules at once would
# interleave their draws (and fork_rng's restores), so seeded construction is serialised.
_LOCK = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int):
    # torch.manual_seed also reseeds every CUDA device, so those states must be saved too.
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with _LOCK, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
