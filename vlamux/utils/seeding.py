"""Seeded construction that leaves every global random stream (CPU and CUDA) as it was."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def seeded(seed: int):
    # torch.manual_seed also reseeds every CUDA device, so those states must be saved too.
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
