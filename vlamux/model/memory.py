"""Dual-pool device memory (D-VLA): rollout-side allocations and model allocations kept apart.

The model's pool holds what the model services own (backbone weights, heads, optimizer state,
activations); the rollout pools hold what the data plane brings in (observations, states, actions
and RL targets copied to the device, and their preprocessing). Kept apart, a burst of rollout
traffic cannot fragment the model's memory, and each side's footprint can be read on its own.

On CUDA a rollout pool is a `torch.cuda.MemPool` of the caching allocator: allocations made on a
thread inside `pools.rollout()` land there. Each model service (its engine thread) has a pool of its
own, and the model's share of the device is what the rollout pools do not hold. Two threads routing
into two pools of one device at once is a case the allocator does not promise to keep apart (its
routing is a device-wide list of pools being recorded into), so on a device only one thread at a time
is inside a rollout pool: the block is a request's host-to-device copy and preprocessing, queued
without waiting for the device. On a CPU (or a torch without MemPool) the same interface exists and
does nothing; its stats read zero.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref

import torch

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_ON_DEVICE: dict[str, weakref.WeakSet] = {}  # device -> the rollout pools made on it
_ROUTING: dict[str, threading.RLock] = {}  # device -> held by the one thread routing into a rollout pool


def _key(device: torch.device | str) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class MemoryPools:
    """One model service's rollout pool, and its view of the device's model pool."""

    def __init__(self, device: torch.device | str):
        self.device = _key(device)
        self.rollout_pool = None
        self._peak = {"model": 0, "rollout": 0}
        self._lock = threading.Lock()
        if self.device.type != "cuda":
            return
        if not (hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")):
            log.warning("torch %s has no torch.cuda.MemPool: rollout and model memory share one pool",
                        torch.__version__)
            return
        with torch.cuda.device(self.device):  # a MemPool belongs to the device current when it is made
            self.rollout_pool = torch.cuda.MemPool()
        with _LOCK:
            _ON_DEVICE.setdefault(str(self.device), weakref.WeakSet()).add(self)
            self._routing = _ROUTING.setdefault(str(self.device), threading.RLock())

    @property
    def separate(self) -> bool:
        return self.rollout_pool is not None

    def rollout(self):
        """Allocations of the calling thread inside this block go to the rollout pool; another
        service's thread on the same device waits at the door (see the module's docstring)."""
        if self.rollout_pool is None:
            return contextlib.nullcontext()
        return self._routed()

    @contextlib.contextmanager
    def _routed(self):
        with self._routing, torch.cuda.use_mem_pool(self.rollout_pool, self.device):
            yield

    def bytes(self) -> tuple[int, int]:
        """(reserved, allocated) bytes of this rollout pool."""
        return _pool_bytes(self.rollout_pool) if self.rollout_pool is not None else (0, 0)

    def stats(self) -> dict:
        """{"model": the device's model pool, "rollout": this service's pool}: reserved and allocated
        bytes now, and the peak allocated bytes seen by any call of this method (sample it to follow
        a run). Reading them walks the allocator's segments: a monitoring call, not a hot-path one."""
        out = device_memory(self.device, own=self)
        with self._lock:
            for name in ("model", "rollout"):
                self._peak[name] = max(self._peak[name], out[name]["allocated_bytes"])
                out[name]["peak_allocated_bytes"] = self._peak[name]
        return out


def device_memory(device: torch.device | str, own: MemoryPools | None = None) -> dict:
    """The device's memory by pool: "model" (everything but the rollout pools) and "rollout" (`own`'s
    pool, or every service's rollout pools on the device together); zeros on a CPU."""
    device = _key(device)
    out = {"model": {"reserved_bytes": 0, "allocated_bytes": 0},
           "rollout": {"reserved_bytes": 0, "allocated_bytes": 0},
           "separate": own.separate if own is not None else bool(_ON_DEVICE.get(str(device)))}
    if device.type != "cuda":
        return out
    with _LOCK:
        pools = list(_ON_DEVICE.get(str(device), ()))
    per = {id(p): p.bytes() for p in pools}
    all_res, all_alloc = sum(r for r, _ in per.values()), sum(a for _, a in per.values())
    mine = per.get(id(own), (0, 0)) if own is not None else (all_res, all_alloc)
    out["rollout"] = {"reserved_bytes": mine[0], "allocated_bytes": mine[1]}
    out["model"] = {"reserved_bytes": max(0, torch.cuda.memory_reserved(device) - all_res),
                    "allocated_bytes": max(0, torch.cuda.memory_allocated(device) - all_alloc)}
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


def reset_peaks(device: torch.device | str) -> None:
    """Start a new peak window on `device`: the allocator's own peak counters go back to what is held
    now (a benchmark step calls it at its start). Nothing on a CPU."""
    device = _key(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peaks(device: torch.device | str) -> dict:
    """What the allocator says of `device` since `reset_peaks`: the peak of allocated and of reserved
    bytes over every pool together (exact: the allocator's counters, not samples), and how the reserved
    bytes divide now between the rollout pools (their segments; a pool keeps its segments until it is
    emptied, so this is its high-water mark) and the model's share (the rest). Zeros on a CPU."""
    device = _key(device)
    out = {"peak_allocated_bytes": 0, "peak_reserved_bytes": 0, "rollout_reserved_bytes": 0,
           "model_reserved_bytes": 0, "separate": bool(_ON_DEVICE.get(str(device)))}
    if device.type != "cuda":
        return out
    with _LOCK:
        pools = list(_ON_DEVICE.get(str(device), ()))
    rollout = sum(p.bytes()[0] for p in pools)
    out.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
               peak_reserved_bytes=torch.cuda.max_memory_reserved(device), rollout_reserved_bytes=rollout,
               model_reserved_bytes=max(0, torch.cuda.memory_reserved(device) - rollout))
    return out


def high_water(readings: list[dict]) -> dict:
    """The largest of each figure over several `peaks` readings (runs one after another)."""
    out: dict = {}
    for reading in readings:
        for k, v in reading.items():
            out[k] = max(out.get(k, 0), v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return out

