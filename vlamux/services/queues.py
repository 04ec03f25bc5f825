"""The two global queues and their schedulers. They decide; they touch no tensors.

Inference Queue: requests of all tenants; a group is due when the queued rows
reach B or the oldest request has waited T. When more is queued than a group
holds, tenants are served least-served first (a virtual counter of rows
served, lifted for a tenant that was idle, in the spirit of VTC) so a busy
tenant cannot starve a light one. A request past its deadline fails.

Training Queue: FIFO per tenant, at most one operation in flight per tenant,
priority classes, readiness, and a staleness limit for RL trajectories; every
tenant's ready head operation is handed out together so the executor can
group the compatible ones.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from vlamux.errors import VlamuxError
from vlamux.utils.stats import quantile


class DeadlineExceeded(VlamuxError, TimeoutError):
    """A request waited past its deadline and was not run."""


class StaleError(VlamuxError):
    """An RL batch was produced by a policy version too far behind the tenant's current one."""


class QueueClosed(VlamuxError):
    """The queue was closed before the request ran."""


class _Stats:
    """Recent waits and group sizes, for metrics."""

    def __init__(self, keep: int = 4096):
        self.waits = collections.deque(maxlen=keep)
        self.group_rows = collections.deque(maxlen=keep)
        self.group_requests = collections.deque(maxlen=keep)
        self.groups = 0

    def snapshot(self) -> dict:
        return {
            "groups": self.groups,
            "wait_p50_s": quantile(self.waits, 0.5, 0.0), "wait_p99_s": quantile(self.waits, 0.99, 0.0),
            "group_rows_mean": statistics.fmean(self.group_rows) if self.group_rows else 0.0,
            "group_requests_mean": statistics.fmean(self.group_requests) if self.group_requests else 0.0,
        }


@dataclass
class Queued:
    tenant: str
    rows: int
    payload: object
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)
    deadline: float = float("inf")


@dataclass(frozen=True)
class InferenceQueueConfig:
    batch_rows: int = 32  # B: dispatch as soon as this many rows are queued
    max_wait_s: float = 0.005  # T: or as soon as the oldest request has waited this long
    deadline_s: float = 30.0  # default deadline of a request

    def __post_init__(self):
        if self.batch_rows < 1 or self.max_wait_s < 0 or self.deadline_s <= 0:
            raise ValueError(f"inference queue config: need batch_rows >= 1, max_wait_s >= 0, deadline_s > 0; "
                             f"got {self}")


class InferenceQueue:
    def __init__(self, config: InferenceQueueConfig | None = None, ready: Callable[[str], bool] | None = None):
        """ready: whether a tenant's requests may join a group now (its slot is resident, where a pager
        moves slots); the others wait, counted for neither B nor T, until it says True (asked again at
        every look)."""
        self.config = config or InferenceQueueConfig()
        self.ready = ready
        # tenants with requests queued, and only those: every look at the queue costs what is queued,
        # not every tenant it ever served (ten thousand of them on a replica that pages its slots)
        self._pending: dict[str, collections.deque[Queued]] = collections.OrderedDict()
        self._served: dict[str, float] = {}  # virtual counter: rows served per tenant
        self._served_max = 0.0  # the largest counter (they only grow)
        self._woken = False
        self._rows = 0
        self._cv = threading.Condition()
        self._closed = False
        self.stats = _Stats()

    def submit(self, tenant: str, rows: int, payload, deadline_s: float | None = None) -> Future:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        item = Queued(tenant, rows, payload)
        item.deadline = item.enqueued + (deadline_s if deadline_s is not None else self.config.deadline_s)
        with self._cv:
            if self._closed:
                raise QueueClosed("the inference queue is closed")
            if tenant not in self._pending or not self._pending[tenant]:
                self._lift(tenant)
            self._pending.setdefault(tenant, collections.deque()).append(item)
            self._rows += rows
            self._cv.notify_all()
        return item.future

    def _lift(self, tenant: str) -> None:
        """A tenant (re)joining starts level with the least-served active tenant, not at zero,
        so it cannot monopolise the queue to make up for time it did not ask for service."""
        active = [self._served[t] for t, q in self._pending.items() if q and t in self._served]
        floor = min(active) if active else self._served_max
        self._served[tenant] = max(self._served.get(tenant, 0.0), floor)

    def forget(self, tenant: str) -> None:
        """A tenant no longer served: its fairness counter goes (anything still queued stays and is
        answered as the runner sees fit)."""
        with self._cv:
            if not self._pending.get(tenant):
                self._pending.pop(tenant, None)
                self._served.pop(tenant, None)

    def depth(self) -> tuple[int, int]:
        """(requests, rows) queued."""
        with self._cv:
            return sum(len(q) for q in self._pending.values()), self._rows

    def _expire(self, now: float) -> None:
        for tenant, q in self._pending.items():
            keep = collections.deque()
            for item in q:
                if item.deadline <= now:
                    self._rows -= item.rows
                    item.future.set_exception(DeadlineExceeded(
                        f"request of tenant {tenant!r} waited {now - item.enqueued:.3f}s, past its deadline"))
                else:
                    keep.append(item)
            self._pending[tenant] = keep
        for tenant in [t for t, q in self._pending.items() if not q]:
            del self._pending[tenant]

    def _takeable(self) -> list[str]:
        return [t for t, q in self._pending.items() if q and (self.ready is None or self.ready(t))]

    def _oldest(self, tenants: list[str]) -> float | None:
        heads = [self._pending[t][0].enqueued for t in tenants]
        return min(heads) if heads else None

    def waiting_since(self) -> dict[str, float]:
        """Tenants with requests queued -> when the oldest came (time.monotonic()), the oldest first."""
        with self._cv:
            heads = sorted((q[0].enqueued, t) for t, q in self._pending.items() if q)
        return {t: at for at, t in heads}

    def wake(self) -> None:
        """Have a `next_group` that waits return now (with what is due, maybe nothing): something its
        caller does between groups (a slot read back from disk to be made resident) is ready."""
        with self._cv:
            self._woken = True
            self._cv.notify_all()

    def fail(self, tenant: str, error: Exception) -> None:
        """Answer every queued request of `tenant` with `error`."""
        with self._cv:
            for item in self._pending.get(tenant) or ():
                self._rows -= item.rows
                if not item.future.done():
                    item.future.set_exception(error)
            self._pending.pop(tenant, None)

    def requeue(self, items: list[Queued]) -> None:
        """Items of a group taken that cannot run after all (their tenant's slot moved between the look
        and the take): back at the head of their tenants' queues, as if never taken."""
        with self._cv:
            for item in reversed(items):
                if item.future.done():
                    continue
                self._pending.setdefault(item.tenant, collections.deque()).appendleft(item)
                self._rows += item.rows
                self._served[item.tenant] = self._served.get(item.tenant, 0.0) - item.rows
            self._cv.notify_all()

    def next_group(self, timeout: float | None = None) -> list[Queued]:
        """Block until a group is due (or `timeout` passes, or the queue closes); return it, maybe empty."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                now = time.monotonic()
                self._expire(now)
                takeable = self._takeable()
                oldest = self._oldest(takeable)
                rows = self._rows if self.ready is None else sum(i.rows for t in takeable for i in self._pending[t])
                if oldest is not None and (rows >= self.config.batch_rows
                                           or now - oldest >= self.config.max_wait_s or self._closed):
                    return self._take(now, takeable)
                if self._closed:
                    return []
                if self._woken:
                    self._woken = False
                    return []
                waits = [] if end is None else [end - now]
                if oldest is not None:
                    waits.append(oldest + self.config.max_wait_s - now)
                heads = [q[0].deadline for q in self._pending.values() if q]
                if heads:
                    waits.append(min(heads) - now)
                if end is not None and now >= end:
                    return []
                self._cv.wait(max(0.0, min(waits)) if waits else None)

    def _take(self, now: float, takeable: list[str]) -> list[Queued]:
        group, rows = [], 0
        while True:
            takeable = [t for t in takeable if t in self._pending]
            if not takeable:
                break
            tenant = min(takeable, key=lambda t: (self._served[t], self._pending[t][0].enqueued))
            item = self._pending[tenant][0]
            if group and rows + item.rows > self.config.batch_rows:
                break
            self._pending[tenant].popleft()
            if not self._pending[tenant]:
                del self._pending[tenant]
            self._rows -= item.rows
            self._served[tenant] += item.rows
            self._served_max = max(self._served_max, self._served[tenant])
            group.append(item)
            rows += item.rows
            self.stats.waits.append(now - item.enqueued)
        self.stats.groups += 1
        self.stats.group_rows.append(rows)
        self.stats.group_requests.append(len(group))
        return group

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for q in self._pending.values():
                while q:
                    item = q.popleft()
                    item.future.set_exception(QueueClosed("the inference queue closed before the request ran"))
            self._rows = 0
            self._cv.notify_all()

    def metrics(self) -> dict:
        requests, rows = self.depth()
        return {"depth_requests": requests, "depth_rows": rows, **self.stats.snapshot()}


@dataclass
class TrainOp:
    """One operation of one tenant on the Training Model Service."""

    tenant: str
    kind: str  # forward_backward | optim_step | save_state | load_state | ...
    payload: object = None
    rows: int = 0  # rows the backbone reads (0 for operations without a backbone forward)
    priority: int = 0  # higher runs first when not everything fits
    ready: Callable[[], bool] | None = None  # not handed out before this says True
    policy_version: int | None = None  # for RL batches: the version that produced the data
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)


class TrainingQueue:
    def __init__(self, version_of: Callable[[str], int] | None = None, max_staleness: int | None = None,
                 max_group_rows: int | None = None, gather_s: float = 0.002):
        self._fifo: dict[str, collections.deque[TrainOp]] = collections.OrderedDict()
        self._in_flight: set[str] = set()
        self._version_of = version_of
        self.max_staleness = max_staleness
        self.max_group_rows = max_group_rows
        self.gather_s = gather_s  # once one operation is ready, wait this long for other tenants' to group
        self._cv = threading.Condition()
        self._closed = False
        self.stats = _Stats()

    def submit(self, op: TrainOp) -> Future:
        with self._cv:
            if self._closed:
                raise QueueClosed("the training queue is closed")
            self._fifo.setdefault(op.tenant, collections.deque()).append(op)
            self._cv.notify_all()
        return op.future

    def _stale(self, op: TrainOp) -> str | None:
        if op.policy_version is None or self.max_staleness is None or self._version_of is None:
            return None
        lag = self._version_of(op.tenant) - op.policy_version
        if lag > self.max_staleness:
            return (f"tenant {op.tenant!r}: batch from policy version {op.policy_version} is {lag} versions "
                    f"behind, more than the limit of {self.max_staleness}")
        return None

    def _heads(self) -> list[TrainOp]:
        heads = []
        for tenant, q in self._fifo.items():
            while q and tenant not in self._in_flight:
                why = self._stale(q[0])
                if why is None:
                    break
                q.popleft().future.set_exception(StaleError(why))
            if q and tenant not in self._in_flight and (q[0].ready is None or q[0].ready()):
                heads.append(q[0])
        return heads

    def next_batch(self, timeout: float | None = None, poll_s: float = 0.01) -> list[TrainOp]:
        """Every tenant's ready head operation (one per tenant, highest priority then oldest first, up to
        `max_group_rows` backbone rows); the tenants are in flight until `done`."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            gathered = False
            while True:
                heads = sorted(self._heads(), key=lambda op: (-op.priority, op.enqueued))
                idle = [t for t, q in self._fifo.items() if not q and t not in self._in_flight]
                if heads and not gathered and self.gather_s > 0 and idle:
                    # some tenant may be about to submit: a short wait lets its operation join the group
                    gathered = True
                    self._cv.wait(self.gather_s)
                    continue
                if heads:
                    batch, rows = [], 0
                    for op in heads:
                        if self.max_group_rows and op.rows and batch and rows + op.rows > self.max_group_rows:
                            continue
                        batch.append(op)
                        rows += op.rows
                    now = time.monotonic()
                    for op in batch:
                        self._fifo[op.tenant].popleft()
                        self._in_flight.add(op.tenant)
                        self.stats.waits.append(now - op.enqueued)
                    self.stats.groups += 1
                    self.stats.group_rows.append(rows)
                    self.stats.group_requests.append(len(batch))
                    return batch
                if self._closed:
                    return []
                now = time.monotonic()
                if end is not None and now >= end:
                    return []
                # readiness is a predicate, not an event: poll it while anything waits on it
                waiting = any(q for t, q in self._fifo.items() if t not in self._in_flight)
                wait = poll_s if waiting else None
                if end is not None:
                    wait = min(wait, end - now) if wait is not None else end - now
                self._cv.wait(wait)

    def done(self, tenant: str) -> None:
        with self._cv:
            self._in_flight.discard(tenant)
            self._cv.notify_all()

    def forget(self, tenant: str) -> None:
        """A tenant whose slot is gone: its empty queue goes (an idle tenant makes groups wait to gather)."""
        with self._cv:
            if not self._fifo.get(tenant) and tenant not in self._in_flight:
                self._fifo.pop(tenant, None)

    def depth(self) -> int:
        with self._cv:
            return sum(len(q) for q in self._fifo.values())

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for q in self._fifo.values():
                while q:
                    q.popleft().future.set_exception(QueueClosed("the training queue closed before the operation ran"))
            self._cv.notify_all()

    def metrics(self) -> dict:
        return {"depth": self.depth(), "in_flight": len(self._in_flight), **self.stats.snapshot()}
