"""Placement by resource on one machine: the model services on some cores, the simulators on others
(the papers' split: model services on accelerators or their own cores, simulation elsewhere).

A Linux thread's CPU affinity is its own and new threads inherit their creator's, so pinning a
process means pinning each of its threads; simulator workers pin themselves when they start.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def check_cpus(cpus: Sequence[int] | None, what: str, machine: bool = False) -> tuple[int, ...] | None:
    """`cpus` as a tuple of cores this process may use (machine=True: cores the machine has: a thread
    already pinned elsewhere may still place its workers there), or an error naming the ones it may not."""
    if cpus is None:
        return None
    cpus = tuple(cpus)
    if not cpus or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus):
        raise ValueError(f"{what}: a non-empty list of core numbers, got {list(cpus)!r}")
    allowed = set(range(os.cpu_count() or 1)) if machine or not hasattr(os, "sched_getaffinity") \
        else os.sched_getaffinity(0)
    bad = sorted(set(cpus) - allowed)
    if bad:
        raise ValueError(f"{what}: cores {bad} are not available to this process (it may use {sorted(allowed)})")
    return cpus


def pin_process(cpus: Sequence[int]) -> None:
    """Every thread of this process, and those it starts from now on, on `cpus` only."""
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):  # a thread that has just ended
            continue


def pin_self(cpus: Sequence[int] | None) -> None:
    """The calling thread (a worker process's main thread, before it starts others) on `cpus`."""
    if cpus:
        os.sched_setaffinity(0, cpus)
