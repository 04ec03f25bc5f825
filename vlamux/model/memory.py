"""Dual-pool device memory (D-VLA): rollout-side allocations and model allocations kept apart.

The model's pool holds what the model services own (backbone weights, heads, optimizer state,
activations); the rollout pool holds what the data plane brings in (observations and trajectory
segments copied to the device, and their preprocessing). Kept apart, a burst of rollout traffic
cannot fragment the model's memory, and each side's footprint can be read on its own.

On CUDA the rollout pool is a `torch.cuda.MemPool` of the caching allocator: allocations made on a
thread inside `pools.rollout()` land there. On a CPU (or a torch without MemPool) the same
interface exists and does nothing; its stats read zero.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

log = logging.getLogger(__name__)

_POOLS: dict[str, MemoryPools] = {}
_LOCK = threading.Lock()


def memory_pools(device: torch.device | str) -> MemoryPools:
    """The pools of `device`, shared by every service on it (one rollout pool per GPU)."""
    key = str(torch.device(device))
    with _LOCK:
        if key not in _POOLS:
            _POOLS[key] = MemoryPools(torch.device(device))
        return _POOLS[key]


class MemoryPools:
    def __init__(self, device: torch.device):
        self.device = device
        self.rollout_pool = None
        self._peak = {"model": 0, "rollout": 0}
        if device.type == "cuda":
            if hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"):
                self.rollout_pool = torch.cuda.MemPool()
            else:
                log.warning("torch %s has no torch.cuda.MemPool: rollout and model memory share one pool",
                            torch.__version__)

    @property
    def separate(self) -> bool:
        return self.rollout_pool is not None

    def rollout(self):
        """Allocations of the calling thread inside this block go to the rollout pool."""
        if self.rollout_pool is None:
            return contextlib.nullcontext()
        return torch.cuda.use_mem_pool(self.rollout_pool, self.device)

    def stats(self) -> dict:
        """{"model": {...}, "rollout": {...}}: reserved and allocated bytes now, and the peak
        allocated bytes seen by any call of this method (sample it to follow a run)."""
        out = {"model": {"reserved_bytes": 0, "allocated_bytes": 0},
               "rollout": {"reserved_bytes": 0, "allocated_bytes": 0}, "separate": self.separate}
        if self.device.type == "cuda":
            reserved = torch.cuda.memory_reserved(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
            r_res, r_alloc = _pool_bytes(self.rollout_pool) if self.rollout_pool is not None else (0, 0)
            out["rollout"] = {"reserved_bytes": r_res, "allocated_bytes": r_alloc}
            out["model"] = {"reserved_bytes": max(0, reserved - r_res), "allocated_bytes": max(0, allocated - r_alloc)}
        for name in ("model", "rollout"):
            self._peak[name] = max(self._peak[name], out[name]["allocated_bytes"])
            out[name]["peak_allocated_bytes"] = self._peak[name]
        return out


def _pool_bytes(pool) -> tuple[int, int]:
    """Reserved and allocated bytes of one MemPool, from its segments."""
    try:
        segments = pool.snapshot(include_traces=False)
    except TypeError:  # older torch: no include_traces
        segments = pool.snapshot()
    if isinstance(segments, dict):  # torch.cuda.memory_snapshot's layout in some releases
        segments = segments.get("segments", [])
    reserved = sum(int(s.get("total_size", 0)) for s in segments)
    allocated = sum(int(s.get("allocated_size", 0)) for s in segments)
    return reserved, allocated
