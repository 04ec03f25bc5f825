"""Jobs accepted while the service has no room for them: they wait here and start when it frees.

A job that a service-wide limit holds back (`max_running_jobs`, the simulator processes of all
tenants) is accepted as `queued` instead of refused; its tenant's own quotas were checked at
submission (those still answer 429, with the numbers). The queue starts waiting jobs in
`fair_order` whenever the ledger gives something back, and answers each waiting job's place: its
position, an estimate of when it starts (from the running jobs' progress; None when nothing known
says), and what it waits for. The decisions are vlamux.jobs.job_queue's pure functions; this
keeps the records.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable

from vlamux.api.quotas import WHAT, Ledger, Need, QuotaRefused
from vlamux.jobs.job_queue import Running, Waiting, estimate_starts, fair_order

log = logging.getLogger(__name__)

TYPICAL_OF = 20  # a kind's typical duration: the median of its last this many finished jobs


@dataclass
class _Entry:
    waiting: Waiting
    start: Callable[[], None]  # hands the job to the Master Service
    waiting_for: str = ""


class JobQueue:
    """`fraction(job_id)`: a running job's progress in [0, 1], or None."""

    def __init__(self, ledger: Ledger, fraction: Callable[[str], float | None]):
        self.ledger, self._fraction = ledger, fraction
        self._waiting: dict[str, _Entry] = {}
        self._running: dict[str, Running] = {}
        self._durations: dict[str, deque] = {}
        self._last_start: dict[str, float] = {}  # tenant -> when a job of theirs last started
        self._lock = threading.Lock()
        self._pumping = threading.Lock()
        self._again = False

    def submit(self, job_id: str, tenant: str, kind: str, need: Need, start: Callable[[], None],
               submitted: float | None = None) -> bool:
        """Queue the job (its tenant's share already held, not yet admitted) and start whatever fits;
        True when this job started."""
        w = Waiting(job_id, tenant, kind, _as_dict(need), time.time() if submitted is None else submitted)
        with self._lock:
            self._waiting[job_id] = _Entry(w, start)
        self.pump()
        return job_id not in self._waiting

    def admitted(self, job_id: str, tenant: str, kind: str, need: Need) -> None:
        """A job that runs without waiting (resumed after a restart: admitted before it)."""
        with self._lock:
            self._running[job_id] = Running(job_id, tenant, kind, _as_dict(need), time.time())
            self._last_start[tenant] = time.time()

    def remove(self, job_id: str) -> bool:
        """Take a waiting job out (cancelled); True when it was waiting."""
        with self._lock:
            return self._waiting.pop(job_id, None) is not None

    def ended(self, job_id: str) -> None:
        """A running job ended (the ledger's release that follows starts what fits)."""
        with self._lock:
            r = self._running.pop(job_id, None)
            if r is not None:
                self._durations.setdefault(r.kind, deque(maxlen=TYPICAL_OF)).append(time.time() - r.started)

    def pump(self) -> None:
        """Start waiting jobs in fair order while the service admits them; the first that does not fit
        stops the round (no job overtakes the head) and says what it waits for."""
        self._again = True
        while self._again:
            # one round at a time; a call during a round (another thread's release, or this thread's
            # own, from a job that failed to start) has it run once more
            if not self._pumping.acquire(blocking=False):
                return
            try:
                self._again = False
                self._round()
            finally:
                self._pumping.release()

    def _round(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    return
                head = self._order()[0]
                entry = self._waiting[head.job_id]
                try:
                    self.ledger.admit(head.tenant, f"job:{head.job_id}")
                except QuotaRefused as e:
                    entry.waiting_for = f"{WHAT[e.resource]}: {e.held} of {e.limit}"
                    return
                del self._waiting[head.job_id]
                now = time.time()
                self._running[head.job_id] = Running(head.job_id, head.tenant, head.kind, head.need, now)
                self._last_start[head.tenant] = now
            try:
                entry.start()
            except Exception:  # noqa: BLE001 - the starter recorded why; the others still start
                log.exception("starting queued job %s", head.job_id)

    def _order(self) -> list[Waiting]:
        return fair_order([e.waiting for e in self._waiting.values()], list(self._running.values()),
                          self._last_start)

    def place(self, job_id: str) -> dict | None:
        """A waiting job's place: position (1: next), of, eta_s and eta_at (None: not known), and what it
        waits for; None when it is not waiting."""
        with self._lock:
            if job_id not in self._waiting:
                return None
            order = self._order()
            running = [Running(r.job_id, r.tenant, r.kind, r.need, r.started, self._fraction(r.job_id))
                       for r in self._running.values()]
            typical = {k: statistics.median(d) for k, d in self._durations.items() if d}
            waiting_for = self._waiting[job_id].waiting_for
        now = time.time()
        # what others hold (env sessions, jobs of before a restart) is capacity the queue cannot plan on
        others = _as_dict(self.ledger.service_use())
        for r in running:
            for k, v in r.need.items():
                others[k] = others.get(k, 0) - v
        capacity = {k: cap - max(0, others.get(k, 0)) for k, cap in self.ledger.service_limits.items()}
        places = estimate_starts(order, running, capacity, now, typical)
        place = next(p for w, p in zip(order, places) if w.job_id == job_id)
        out = asdict(place)
        out["eta_at"] = None if place.eta_s is None else now + place.eta_s
        out["waiting_for"] = waiting_for or "its turn"
        return out

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)


def _as_dict(need: Need) -> dict:
    return {k: v for k, v in asdict(need).items() if v}
