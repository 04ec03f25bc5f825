"""Shared helpers of the benchmark scripts: timing, tables, result files."""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from cells import cell_key, parse_grid, parse_models  # noqa: F401 - the benchmarks import them from here

RESULTS = Path(__file__).resolve().parent / "results"


def sync(device) -> None:
    # a benchmark's contender is timed whole: here a device-wide wait is the point
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def interleaved_medians(contenders: dict[str, Callable[[], object]], repeats: int, device: str,
                        min_seconds: float = 0.0, max_rounds: int = 40, warm_each: bool = False) -> dict[str, float]:
    """Median seconds per contender, run in alternating order so drift on a shared machine hits all
    alike; at least `repeats` rounds, more (up to `max_rounds`) until each contender has run
    `min_seconds` in all, so short cells get enough samples to beat the noise.

    warm_each: each timed call follows an untimed call of the same contender. Without it a contender
    that runs after another one's different modules starts with cold caches, and in alternating order
    that happens to some more often than to others (A B C D, then D C B A: A always follows itself or
    B, while B follows C every other round; with A and B one kind of call and C and D another, B is
    timed cold half the time and A never); with it every timed call is a steady-state one, at twice the
    time."""
    return {k: statistics.median(v) for k, v in
            interleaved_samples(contenders, repeats, device, min_seconds, max_rounds, warm_each).items()}


def interleaved_samples(contenders: dict[str, Callable[[], object]], repeats: int, device: str,
                        min_seconds: float = 0.0, max_rounds: int = 40,
                        warm_each: bool = False) -> dict[str, list[float]]:
    """Every contender's timed samples, taken as `interleaved_medians` describes."""
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    r = 0
    while r < repeats or (r < max_rounds and min(sum(v) for v in samples.values()) < min_seconds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if warm_each:
                contenders[name]()
            samples[name].append(timed(contenders[name], device))
        r += 1
    return samples


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """columns: (key, format spec) pairs."""
    header = [k for k, _ in columns]
    cells = [[format(row[k], f) for k, f in columns] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def environment(device, dtype: torch.dtype | None = None) -> dict:
    env = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "machine": platform.machine(), "processor": platform.processor() or platform.machine()}
    if dtype is not None:
        env["dtype"] = str(dtype).removeprefix("torch.")
    if str(device).startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def write_json(name: str, payload, out: str | None = None) -> Path:
    """`payload` as JSON to `out` (default bench/results/NAME), atomically: written beside it, then renamed
    over it, so a reader (or a run killed mid-write) never sees half a file."""
    path = Path(out) if out else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class ResultFile:
    """A benchmark's result file, written as its cells finish, so a run cut short (a time limit, a kill)
    keeps every cell it measured. The file holds the payload plus "partial" (true until `finish`),
    "planned" (the keys of the cells the run means to measure) and "done" (those finished, in order); it
    is rewritten atomically (`write_json`) at the start and after each cell, and once more by `finish`
    with "partial": false. `payload` is the benchmark's own dict: change it in place between cells (a
    grid benchmark appends to its "cells" with `cell`), or hand `finish` the final one."""

    def __init__(self, name: str, out: str | None, planned: list[str], **payload):
        self.name, self.out = name, out
        self.planned = list(planned)
        self.done: list[str] = []
        self.payload: dict = payload
        self.path = self._write(partial=True)

    def cell(self, key: str, cell: dict) -> None:
        """A grid cell finished: appended to the payload's "cells", and the file rewritten."""
        self.payload.setdefault("cells", []).append(cell)
        self.mark(key)

    def mark(self, key: str) -> None:
        """The planned cell `key` finished (its figures already in the payload): the file rewritten."""
        self.done.append(key)
        self._write(partial=True)

    def finish(self, payload: dict | None = None) -> Path:
        """The run completed: the final payload (default: the one built up), "partial": false."""
        if payload is not None:
            self.payload = payload
        return self._write(partial=False)

    def _write(self, partial: bool) -> Path:
        return write_json(self.name, {"partial": partial, "planned": self.planned, "done": self.done,
                                      **self.payload}, self.out)


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (env workers count once they exit)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def add_cell_arguments(ap, result: str, default_seconds: str) -> None:
    """The grid benchmarks' shared options: which cells, how many timed runs, how long, where to write."""
    ap.add_argument("--grid", default=None, metavar="N:b,...", help="cells to run, e.g. 1:1,8:1 (default: the "
                                                                      "full grid, or the quick one)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per contender (median is reported)")
    ap.add_argument("--min-seconds", type=float, default=None,
                    help=f"time each contender at least this long per cell (default {default_seconds})")
    ap.add_argument("--out", default=None, help=f"result file (default bench/results/{result}[_quick].json)")


def cell_plan(args, grids: tuple[list, list], repeats: tuple[int, int], seconds: tuple[float, float]
              ) -> tuple[list[tuple[int, int]], int, float]:
    """(cells, repeats, seconds per contender) from the options of `add_cell_arguments`; each default a
    (quick, full) pair picked by --quick."""
    k = 0 if args.quick else 1
    grid = parse_grid(args.grid) if args.grid else grids[k]
    return grid, args.repeats or repeats[k], args.min_seconds if args.min_seconds is not None else seconds[k]


class AllocatorPeaks:
    """A device's memory over a benchmark's run, from the allocator (vlamux.model.memory.peaks): its
    peak counters reset on entry, read on exit into `last` (peak allocated and reserved over every
    pool, and the reserved bytes of the rollout pools and of the model's share); zeros on a CPU."""

    def __init__(self, device):
        self.device = device
        self.last: dict = {}

    def __enter__(self) -> "AllocatorPeaks":
        from vlamux.model.memory import reset_peaks

        reset_peaks(self.device)
        return self

    def __exit__(self, *exc) -> None:
        from vlamux.model.memory import peaks

        self.last = peaks(self.device)


def plain_heads(heads: list, mode: str, state: torch.Tensor, actions: torch.Tensor,
                optimizers: list | None = None) -> Callable:
    """Each head on its own b rows of a feature, as plain calls: inference samples; train takes the
    head's loss and backward, then its plain torch optimizer's step (`optimizers`, one per head) when
    given. Returns work(head_index, feature, rows): rows index `state` and `actions`."""
    mask = torch.ones(actions.shape[:2], dtype=torch.bool, device=actions.device)

    def work(i, feature, rows):
        head = heads[i]
        feature = feature.to(next(head.parameters()).dtype)  # a bf16 backbone's features, for fp32 heads
        if mode == "inference":
            with torch.no_grad():
                head.sample(feature, state[rows])
            return
        loss, _ = head.loss(feature, state[rows], actions[rows], mask[rows])
        loss.backward()
        if optimizers:
            optimizers[i].step()
            optimizers[i].zero_grad(set_to_none=True)

    return work


def plain_optimizers(heads: list, lr: float = 1e-4) -> list:
    """A plain torch AdamW per head: the optimizer step every tenant of a train cell takes, done
    without vlamux (the heads' parameters move a little; the timings do not depend on their values),
    as torch's fastest kernel for it (fused, where the device has one)."""
    return [plain_adamw(h.parameters(), lr) for h in heads]


def plain_adamw(params, lr: float) -> torch.optim.AdamW:
    params = list(params)
    return torch.optim.AdamW(params, lr=lr, fused=True if params[0].device.type in ("cpu", "cuda") else None)


def plain_model(backbone, heads: list, b: int, mode: str, profile) -> dict[str, Callable[[], None]]:
    """The limit of grouping, measured apart from vlamux's group path: the plain model (the backbone,
    then each head on its own rows) on one dense batch of len(heads) * b rows of a single shape
    (`profile`'s, no padding), against one (backbone, head) call of b rows per head. mode "inference"
    samples; "train" takes each head's loss, its backward and its optimizer step (a plain AdamW), as
    the contenders take every tenant's. Contenders for `interleaved_medians`:
    limit = dense_split / dense_one."""
    import copy

    from vlamux.model.synthetic import make_batch

    heads = [copy.deepcopy(h) for h in heads]  # the limit's own modules: nothing of the contenders' moves
    n = len(heads)
    g = torch.Generator().manual_seed(7)
    obs, actions = make_batch(profile, n * b, g)
    dense = backbone.prepare(obs)
    parts = [backbone.prepare(make_batch(profile, b, g)[0]) for _ in range(n)]  # the same shape, b rows each
    dev = backbone.device
    state = torch.randn(n * b, profile.state_dim, generator=g).to(dev)
    head_work = plain_heads(heads, mode, state, actions.to(dev),
                            plain_optimizers(heads) if mode == "train" else None)

    def one():
        with torch.no_grad():
            f = backbone(dense)
        for i in range(n):
            rows = slice(i * b, (i + 1) * b)
            head_work(i, f.select(rows), rows)

    def split():
        for i in range(n):
            with torch.no_grad():
                f = backbone(parts[i])
            head_work(i, f, slice(i * b, (i + 1) * b))

    return {"dense_one": one, "dense_split": split}


@functools.lru_cache(maxsize=1)
def split_cores() -> dict:
    """The papers' resource split on this machine's cores: a quarter (at least one) for the model
    services, the rest for the simulators; on two cores, one each (RuntimeConfig keyword arguments).
    Taken once, before any runtime pins this process."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--placement split needs at least two cores")
    k = max(1, len(cores) // 4)
    return {"service_cpus": tuple(cores[:k]), "env_cpus": tuple(cores[k:])}
