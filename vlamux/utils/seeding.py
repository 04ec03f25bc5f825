"""Seeded construction that leaves every global random stream as it was.

Modules are built on the CPU and moved to their device afterwards, so only the CPU generator is
seeded and restored: no CUDA generator is touched and no CUDA context is opened on any GPU (the
old `torch.manual_seed` + `fork_rng(all devices)` opened one on every visible GPU per slot). A module
too large to build on the CPU first is built on its GPU (`seeded_on`): that device's generator alone.
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


@contextlib.contextmanager
def seeded_on(seed: int, device: torch.device):
    """Seeded construction on `device` (a CUDA device: its own generator, restored after; modules made
    inside are placed there), or `seeded` on a CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        with seeded(seed):
            yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK, torch.random.fork_rng(devices=[index]), torch.device(torch.device("cuda", index)):
        torch.cuda.manual_seed(seed) if index == torch.cuda.current_device() else \
            torch.cuda.default_generators[index].manual_seed(seed)
        yield

