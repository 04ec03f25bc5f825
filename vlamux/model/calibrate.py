"""A group size learned from the hardware: how long the backbone takes by rows, on its own device and
dtype, and the largest group that still pays.

Grouping k requests into one forward saves what the k calls would each spend beyond their rows'
work (launches, Python, small kernels); once a forward's time grows in proportion to its rows (a
saturated device) or faster (caches overflowing), a bigger group saves nothing, and can cost more
than serial calls. `measure` times the backbone at 1, 2, 4, ... rows (interleaved, the fastest of 5 calls each);
`choose_cap` takes the largest size whose time per row is within 3% of the lowest, among those
within a latency budget. The probe is a group of one-row requests, as the runner runs a group of
many tenants' requests (the built-in backbone attends per request; a VLM pads them). The runner then splits groups at that many rows, so a
group is never slower than its requests run one by one.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch

DOUBLING_GAIN = 0.03  # a doubling must save at least this fraction of two half-size calls
MAX_ROWS = 256
MAX_CALL_S = 0.25  # stop measuring past forwards this long (a budget larger than this is not probed)
MAX_PROBE_S = 2.0  # and once probing has taken this long (a slow or busy CPU reaches fewer sizes in it)
# timed calls of each size after the probe, the fastest kept (5 chose caps within the same run-to-run
# spread, 32-64 rows on the tiny backbone here, in twice the time)
REPEATS = 3
PROBE_IMAGE_SIZE = 128
WAIT_STEP_S = 0.01  # a stepped calibration waits this long a step for another probe of the process  # the probe's cameras where the backbone takes any size


@dataclass
class GroupCurve:
    """A backbone's forward time by rows on one device, and the group cap chosen from it."""

    backbone_id: str
    rows: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    cap: int | None = None  # rows; None: not measured (no cap)
    budget_s: float | None = None
    reason: str = ""

    def describe(self) -> dict:
        return {"rows": self.cap, "budget_s": self.budget_s, "reason": self.reason,
                "curve": [[r, round(s, 6)] for r, s in zip(self.rows, self.seconds)]}


def probe_group(backbone, rows: int, seed: int = 0) -> list:
    """A group of `rows` one-row requests in the backbone's input form (two cameras at its image size,
    or, for a VLM that takes any size, 128 px: larger images cost more tokens a row, so a cap learned
    on them is the safe one for smaller ones; instructions of a few lengths, a state): how a group of
    many tenants' requests runs (each request its own attention, or its own padding), synthetic."""
    from vlamux.model.synthetic import TaskProfile, make_batch

    size = backbone.schema.image_size or PROBE_IMAGE_SIZE
    templates = ["pick up the {color} cube", "push {color} away", "touch the {color} ball now", "grab {color}"]
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        profile = TaskProfile({"agentview": (size, size), "wrist": (size, size)}, 4, 4, 8, templates[i % 4])
        out.append(backbone.prepare(make_batch(profile, 1, g)[0]))
    return out


def measure(backbone, lane, max_rows: int = MAX_ROWS, repeats: int = REPEATS, max_call_s: float = MAX_CALL_S
            ) -> tuple[list[int], list[float]]:
    """Forward seconds at 1, 2, 4, ... rows: the fastest of `repeats` calls, each size's calls
    interleaved with the others' (on a shared machine other work only ever adds time, so the fastest
    call is the hardware's); stops at `max_rows` or once a call takes `max_call_s`. `lane`: the
    runner's (its stream and its event timing)."""
    return _drain(measure_steps(backbone, lane, max_rows, repeats, max_call_s))


def measure_steps(backbone, lane, max_rows: int = MAX_ROWS, repeats: int = REPEATS, max_call_s: float = MAX_CALL_S):
    """`measure`, one forward a step: a generator that yields after each timed forward (a service serves
    its queued groups in between) and returns (rows, seconds). A forward's time is its own: each is
    waited for before the next step. MAX_PROBE_S bounds the probe's own time (its inputs' making and its
    timed calls; not each shape's first call, which carries CUDA's start-up, nor what is served
    between the steps)."""
    sizes, batches, first = [], {}, []
    r, past, spent = 1, 0, 0.0
    while r <= max_rows and past < 2 and spent < MAX_PROBE_S:
        # probe on until two doublings in a row stopped paying
        t0 = time.perf_counter()
        with torch.no_grad():
            batches[r] = probe_group(backbone, r, seed=r)
            t1 = time.perf_counter()
            backbone.forward_group(batches[r])  # warm-up: this shape's first call (CUDA/cuBLAS start-up)
            _done(lane.mark())
            t2 = time.perf_counter()
            start = lane.mark()
            backbone.forward_group(batches[r])  # a first estimate
            end = _done(lane.mark())
        sizes.append(r)
        first.append(lane.seconds(start, end))
        spent += time.perf_counter() - t0 - (t2 - t1)  # all of the step's time but its warm-up call
        if first[-1] > max_call_s:
            break
        past = past + 1 if len(first) > 1 and first[-1] > 2 * first[-2] * (1 - DOUBLING_GAIN) else 0
        r *= 2
        yield
    times: dict[int, list[float]] = {r: [] for r in sizes}
    for _ in range(repeats):
        for r in sizes:
            with torch.no_grad():
                start = lane.mark()
                backbone.forward_group(batches[r])
                end = _done(lane.mark())
            times[r].append(lane.seconds(start, end))
            yield
    return sizes, [min(times[r]) for r in sizes]


def _drain(steps):
    """Run a step generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _done(mark):
    """Wait for a mark (a CUDA event: that event only, not the device) before it is read."""
    if hasattr(mark, "synchronize"):
        mark.synchronize()
    return mark


def choose_cap(rows: list[int], seconds: list[float], budget_s: float | None = None,
               gain: float = DOUBLING_GAIN) -> tuple[int, str]:
    """The largest group size whose time per row is within `gain` of the lowest measured (a group where
    rows start to cost more is where grouping stops paying), among the sizes within `budget_s` (the
    latency a bigger group costs is the budget's to bound); and why."""
    within = [(r, t) for r, t in zip(rows, seconds) if budget_s is None or t <= budget_s] or [(rows[0], seconds[0])]
    best = min(t / r for r, t in within)
    cap, t = [(r, t) for r, t in within if t / r <= best * (1 + gain)][-1]
    over = "" if len(within) == len(rows) else f"; {rows[len(within)]} rows pass the {budget_s * 1e3:.0f} ms budget"
    return cap, f"{cap} rows: {t / cap * 1e3:.2f} ms a row, within {gain:.0%} of the lowest measured{over}"


# Curves measured in this process, by what they hold for (`conditions`): a service started again in
# the same process (the Health Manager's restart, a second runtime) takes its backbone's curve from
# here instead of probing for seconds again. Measuring on request (`force`) always probes.
_MEASURED: dict[tuple, GroupCurve] = {}
# One probe at a time in a process: two services probing at once (a restart beside a replica being
# added) would each time the other's load, and the skewed curve would then be kept.
_PROBING = threading.Lock()


def conditions(backbone, lane_dtype: torch.dtype, budget_s: float | None) -> tuple:
    """What a curve holds for: the backbone (its id names its architecture, weights and input size),
    the device and precision it runs in (its weights', and the lane's autocast dtype), the cores and
    threads torch has, the latency budget."""
    p = next(backbone.parameters(), torch.empty(0))
    cpus = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else None
    return (backbone.backbone_id, backbone.num_parameters(), str(p.device), str(p.dtype), str(lane_dtype),
            budget_s, torch.get_num_threads(), cpus)


def measured(backbone, budget_s: float | None = None) -> GroupCurve | None:
    """The curve this process measured for `backbone` at its own dtype (a runner's lane), if any."""
    return _MEASURED.get(conditions(backbone, backbone.dtype, budget_s))


def calibrate(backbone, lane, budget_s: float | None = None, reuse: bool = False, wait_s: float = 60.0,
              **kw) -> GroupCurve:
    """Measure `backbone`'s curve and choose its cap; reuse=True: a curve this process measured under
    the same `conditions` is returned as it is (without waiting for another probe). A TimeoutError
    after `wait_s` if another probe of this process holds on (a service stuck mid-calibration)."""
    key = _key(backbone, lane, budget_s, kw)
    if reuse and key in _MEASURED:
        return _MEASURED[key]
    if not _PROBING.acquire(timeout=wait_s):
        raise TimeoutError(f"another group calibration of this process has run for over {wait_s:g} s")
    try:
        return _drain(_probe(backbone, lane, budget_s, reuse, kw))
    finally:
        _PROBING.release()


def calibrate_steps(backbone, lane, budget_s: float | None = None, reuse: bool = False, **kw):
    """`calibrate` in steps, for a service that serves between them: a generator that yields after
    each probe forward, and while another probe of this process runs (waiting for it at most
    `WAIT_STEP_S` a step: its caller never blocks for long), and returns the curve. Closing the
    generator part-way releases the probe."""
    while not _PROBING.acquire(timeout=WAIT_STEP_S):
        yield
    try:
        return (yield from _probe(backbone, lane, budget_s, reuse, kw))
    finally:
        _PROBING.release()


def _key(backbone, lane, budget_s, kw: dict) -> tuple:
    return (*conditions(backbone, lane.dtype, budget_s), *sorted(kw.items()))


def _probe(backbone, lane, budget_s: float | None, reuse: bool, kw: dict):
    """The probe itself (the caller holds _PROBING): steps of `measure_steps`, then the cap."""
    key = _key(backbone, lane, budget_s, kw)
    if reuse and key in _MEASURED:
        return _MEASURED[key]
    t0 = time.perf_counter()
    rows, seconds = yield from measure_steps(backbone, lane, **kw)
    cap, reason = choose_cap(rows, seconds, budget_s)
    curve = GroupCurve(backbone.backbone_id, rows, seconds, cap, budget_s, reason)
    curve.measured_in_s = time.perf_counter() - t0
    _MEASURED[key] = curve
    return curve
