"""Where a model service runs, and how its data crosses between host and device.

`resolve_device` / `resolve_dtype` turn a user's choice ("auto", "cuda:1", "bfloat16" ...) into
torch objects with errors that name what is wrong. A `Lane` is one model service's execution
context: its device, its compute precision, its own CUDA stream (so the Training and each
Inference Model Service overlap on one GPU instead of serialising on the default stream), a
second stream for the control plane's weight copies, and a clock that times work on the stream
with CUDA events, never with a device-wide synchronize.

Lanes have a priority: the Inference Model Service's is "high" (the simulators wait on its answers),
the Training Model Service's "low" where it shares a GPU or the services' own cores with inference
(throughput work that can wait a few milliseconds; RuntimeConfig.lane_priority decides). On CUDA that
is the lane's stream priority, so an inference kernel is scheduled ahead of training's queued ones
on a shared GPU; on a CPU, the low lane's engine thread lowers its own scheduling priority (nice),
so where both services share cores the OS runs inference first. Raising a priority needs privileges
a service does not have; lowering one never does.

The data plane's rule: tensors enter the device from pinned host memory with non-blocking copies
(`to_device`), and every tensor that leaves a model service is on the host (`Lane.to_host`, one
wait on this lane's stream per group). On a CPU all of it degrades to plain calls.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch
from torch import Tensor

log = logging.getLogger(__name__)

PRIORITIES = ("high", "normal", "low")
CUDA_STREAM_PRIORITY = {"high": -1, "normal": 0, "low": 0}  # lower is served first; 0 is CUDA's least
LOW_NICE = 10  # a low lane's thread: at nice +10 the OS gives a runnable nice-0 thread ~90% of a core

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
DTYPE_CHOICES = "auto, float32 (fp32) or bfloat16 (bf16)"


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """'auto' (or None): the current CUDA device where one is present, else the CPU."""
    if isinstance(name, torch.device):
        name = str(name)
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"device: {name!r} is not a device; choose {DEVICE_CHOICES}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device: {name!r} is not supported; choose {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for, but this machine has no CUDA device (torch "
                         f"{torch.__version__}); use --device cpu or auto")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: {name!r} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' (or None): bfloat16 on CUDA, float32 on the CPU. float16 is refused: the heads would
    need loss scaling, and bfloat16 runs wherever float16 would."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"dtype: {name} is not supported; choose {DTYPE_CHOICES}")
        return name
    key = (name or "auto").strip().lower()
    if key == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if key not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not supported; choose {DTYPE_CHOICES}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def copy_into(dst: Tensor, src: Tensor) -> None:
    """dst[...] = src, asynchronous where dst is on a GPU (src pinned first if it is not)."""
    if dst.device.type == "cuda" and src.device.type == "cpu":
        dst.copy_(src if src.is_pinned() else src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def to_device(t: Tensor, device: torch.device | str | None, dtype: torch.dtype | None = None) -> Tensor:
    """`t` on `device` (and `dtype`): a host tensor bound for a GPU is pinned first (if it is not
    already) so that the copy is asynchronous; a copy from pageable memory would wait for the
    stream. A tensor already there is returned as is."""
    if device is None:
        return t if dtype is None else t.to(dtype)
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        if not t.is_pinned():
            t = t.pin_memory()
        t = t.to(device, non_blocking=True)
        return t if dtype is None else t.to(dtype)
    return t.to(device=device, dtype=dtype)


def to_numpy(t: Tensor):
    """A tensor's values as a numpy array wherever the tensor lives: one on a device is copied to the
    host first (`.numpy()` on it would raise). Model services return host tensors already; the data
    plane calls this anyway, so a service that did not cannot crash a workflow."""
    return t.detach().cpu().numpy()


def map_tensors(tree, fn):
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(v, fn) for v in tree)
    return tree


def gather_to_host(tensors: list[Tensor], pinned: bool = True) -> list[Tensor]:
    """Host copies of `tensors` (all on one device) made by one copy: their bytes packed into one device
    buffer (16-byte aligned, so any dtype can be viewed at its offset), copied asynchronously into one
    host buffer (pinned: the copy does not wait), each returned as a view of its bytes there. The caller
    waits for the current stream before reading them."""
    if not tensors:
        return []
    spans, total = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        spans.append((total, n))
        total += -(-n // 16) * 16
    packed = torch.empty(max(total, 16), dtype=torch.uint8, device=tensors[0].device)
    for t, (at, n) in zip(tensors, spans):
        if n:
            packed[at:at + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
    host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=pinned)
    host.copy_(packed, non_blocking=pinned)
    return [host[at:at + n].view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
            for t, (at, n) in zip(tensors, spans)]


def to_cpu(tree):
    """Every tensor of a nested dict/list/tuple on the CPU, detached (a plain, waiting copy)."""
    return map_tensors(tree, lambda t: t.detach().cpu())


class Lane:
    """One model service's device, precision and CUDA streams (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 priority: str = "normal"):
        if priority not in PRIORITIES:
            raise ValueError(f"lane priority: one of {', '.join(PRIORITIES)}; got {priority!r}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.priority = priority
        self.cuda = self.device.type == "cuda"
        level = CUDA_STREAM_PRIORITY[priority]
        self.stream = torch.cuda.Stream(self.device, priority=level) if self.cuda else None
        self.copy_stream = torch.cuda.Stream(self.device, priority=level) if self.cuda else None
        # a paging service's slot moves (its mover thread), overlapped with the groups on `stream`
        self.page_stream = torch.cuda.Stream(self.device, priority=level) if self.cuda else None

    def __repr__(self) -> str:
        return f"Lane({self.device}, {dtype_name(self.dtype)}, {self.priority})"

    def claim_thread(self) -> int | None:
        """The calling thread runs this lane's work from now on (a service's engine thread): on a CPU,
        a low lane's thread lowers its scheduling priority by LOW_NICE. Returns the thread's nice
        value after (None where nothing changed)."""
        if self.cuda or self.priority != "low" or not hasattr(os, "setpriority"):
            return None
        tid = threading.get_native_id()
        try:
            nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + LOW_NICE)
            os.setpriority(os.PRIO_PROCESS, tid, nice)  # Linux: a thread id names that thread alone
        except OSError as e:
            log.warning("lane %s: could not lower the engine thread's priority: %s", self, e)
            return None
        return nice

    # ---- where work runs ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self):
        """Make this lane's stream (and device) current on the calling thread."""
        if not self.cuda:
            yield self
            return
        # The lane's stream does not wait for the legacy default stream by itself (it is created
        # non-blocking): order it after whatever the caller queued there (inputs, loads).
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield self

    @contextlib.contextmanager
    def importing(self, ready=None):
        """Copies into this lane's tensors (a new policy version) on the copy stream, after `ready` (an
        event of the producer's copies, or None) and after the work queued so far; the next work
        queued on this lane waits for them, so they land between two groups."""
        if not self.cuda:
            if ready is not None:  # a GPU producer's copies, read here by the host
                ready.synchronize()
            yield
            return
        self.copy_stream.wait_stream(self.stream)
        if ready is not None:
            self.copy_stream.wait_event(ready)
        try:
            # What is allocated here belongs to the copy stream; it is safe to read on the lane's,
            # because every block reused here was first waited for (wait_stream above).
            with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
                yield
        finally:
            self.stream.wait_stream(self.copy_stream)

    @contextlib.contextmanager
    def paging(self, after_lane: bool = False):
        """Slot moves between tiers on the calling thread (a paging service's mover), on the page stream,
        so that they overlap the groups queued on the lane's. after_lane: the copies wait for the work
        queued on the lane so far (a slot's copy out, after the last group that used it); a copy in
        needs not. On leaving, the calling thread waits for the page stream's copies alone (an event,
        not the device): a slot handed to the lane, or a host buffer let go, is complete."""
        if not self.cuda:
            yield
            return
        if after_lane:
            self.page_stream.wait_stream(self.stream)
        with torch.cuda.device(self.device), torch.cuda.stream(self.page_stream):
            yield
            done = torch.cuda.Event()
            done.record(self.page_stream)
        done.synchronize()

    def export(self, tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], object]:
        """Host copies of `tensors` (a policy version) and an event that marks them complete (None
        on a CPU). On CUDA the tensors are cloned on the current stream (microseconds), then copied to
        pinned memory on the copy stream, so the next training step need not wait for the transfer."""
        if not self.cuda:
            return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}, None
        current = torch.cuda.current_stream(self.device)
        clones = {k: v.detach().clone() for k, v in tensors.items()}
        self.copy_stream.wait_stream(current)
        host = {}
        with torch.cuda.stream(self.copy_stream):
            for k, c in clones.items():
                host[k] = torch.empty(c.shape, dtype=c.dtype, pin_memory=True)
                host[k].copy_(c, non_blocking=True)
                c.record_stream(self.copy_stream)  # the clone lives until its copy is done
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        return host, done

    def autocast(self):
        """Heads run in the backbone's precision (bf16 on CUDA) with fp32 master weights; no-op in fp32."""
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    # ---- data plane ---------------------------------------------------------------------------------
    def to_device(self, t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        return to_device(t, self.device, dtype)

    def to_host(self, tree):
        """Every tensor of a nested dict/list/tuple on the host, detached. On CUDA: one asynchronous copy
        of all the device tensors' bytes into one pinned buffer (`gather_to_host`) on this lane's stream,
        one wait on that stream (not on the device), then each tensor copied out of the buffer on the
        host. Call it inside `active()` (the copies are queued on the current stream)."""
        if not self.cuda:
            return map_tensors(tree, lambda t: t.detach() if t.device.type == "cpu" else t.detach().cpu())
        on_device: list[Tensor] = []
        map_tensors(tree, lambda t: on_device.append(t) if t.device.type != "cpu" else None)
        views = gather_to_host(on_device, pinned=True)
        self.wait()
        # each result its own tensor (a host copy): one tenant's output pickled, or kept, is not the round's
        copies = iter([v.clone() for v in views])
        return map_tensors(tree, lambda t: t.detach() if t.device.type == "cpu" else next(copies))

    def wait(self) -> None:
        """Block the calling thread until this lane's queued work is done (an event on its stream)."""
        if self.cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()

    # ---- clock ---------------------------------------------------------------------------------------
    def mark(self):
        """A point in this lane's work: a CUDA event on the current stream, or the host clock."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def seconds(self, start, end) -> float:
        """Time between two marks; on CUDA only once both have completed (after `to_host`/`wait`)."""
        if not self.cuda:
            return end - start
        return start.elapsed_time(end) / 1000.0


def add_device_arguments(parser) -> None:
    """--device and --dtype on an argparse entry point (checked by `parse_device_arguments`)."""
    parser.add_argument("--device", default="auto", help=f"where the model services run: {DEVICE_CHOICES} "
                                                         f"(default auto: CUDA when present)")
    parser.add_argument("--dtype", default="auto", help=f"backbone precision: {DTYPE_CHOICES} (default auto: "
                                                        f"bfloat16 on CUDA, float32 on a CPU)")


def parse_device_arguments(parser, args) -> tuple[torch.device, torch.dtype]:
    """The resolved (device, dtype) of parsed arguments; a bad value exits with the parser's error."""
    try:
        device = resolve_device(args.device)
        return device, resolve_dtype(args.dtype, device)
    except ValueError as e:
        parser.error(str(e))
