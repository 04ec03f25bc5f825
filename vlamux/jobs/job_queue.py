"""Jobs waiting for the service's capacity: in what order they start, and when each may.

A job a service-wide limit holds back (not its tenant's own quota: that is refused at once) waits
here. The order is fair across tenants: the next to start is the oldest waiting job of the tenant
with the fewest jobs running or ahead of it, so a tenant with many queued jobs does not hold the
others back. Jobs start strictly in that order (no job overtakes the head, even where it would fit).
A job's estimate comes from the running jobs' progress: one that is a fraction f done after t
seconds has t(1 - f)/f left; one with no progress yet takes its kind's typical duration when one is
known, else its end (and every start that waits for it) is unknown, said as None, never invented.
Pure functions; the Master Service keeps the records.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Waiting:
    job_id: str
    tenant: str
    kind: str
    need: dict  # resource -> amount (e.g. {"jobs": 1, "env_processes": 8})
    submitted: float


@dataclass(frozen=True)
class Running:
    job_id: str
    tenant: str
    kind: str
    need: dict
    started: float
    fraction: float | None = None  # progress in [0, 1]; None: not known yet


@dataclass(frozen=True)
class Place:
    position: int  # 1: next to start
    of: int
    eta_s: float | None  # seconds from now until it starts; None: not known


def fair_order(waiting: list[Waiting], running: list[Running], last_start: dict | None = None) -> list[Waiting]:
    """The order `waiting` jobs start in: round robin over tenants by load (jobs running or already
    ordered), ties to the tenant that started a job least recently (`last_start`: tenant -> time, and its
    running jobs' starts; never first; a job ordered here starts after all of those), then to the one whose oldest waiting job is older; each tenant's jobs oldest first. So a
    tenant whose job just ended does not go before one that has waited behind it."""
    load = Counter(r.tenant for r in running)
    started = dict(last_start or {})
    for r in running:
        started[r.tenant] = max(started.get(r.tenant, r.started), r.started)
    queues: dict[str, list[Waiting]] = {}
    for w in sorted(waiting, key=lambda w: (w.submitted, w.job_id)):
        queues.setdefault(w.tenant, []).append(w)
    order, clock = [], max(started.values(), default=0.0)
    while queues:
        tenant = min(queues, key=lambda t: (load[t], started.get(t, float("-inf")), queues[t][0].submitted,
                                            queues[t][0].job_id))
        order.append(queues[tenant].pop(0))
        load[tenant] += 1
        clock += 1.0  # ordered: it starts after every start so far
        started[tenant] = clock
        if not queues[tenant]:
            del queues[tenant]
    return order


def remaining_s(job: Running, now: float, typical_s: dict | None = None) -> float | None:
    """Seconds until `job` ends: from its progress, else its kind's typical duration less its time so far."""
    elapsed = max(0.0, now - job.started)
    if job.fraction is not None and job.fraction > 0:
        return elapsed * (1.0 - min(job.fraction, 1.0)) / job.fraction
    typical = (typical_s or {}).get(job.kind)
    return None if typical is None else max(0.0, typical - elapsed)


def _fits(need: dict, used: Counter, capacity: dict) -> bool:
    return all(used[k] + v <= capacity[k] for k, v in need.items() if k in capacity)


def estimate_starts(order: list[Waiting], running: list[Running], capacity: dict, now: float,
                    typical_s: dict | None = None) -> list[Place]:
    """Each job of `order` (fair_order's) with its position and the seconds until it can start: the
    running jobs end as their progress says, and each waiting job, once started, runs its kind's
    typical duration where one is known."""
    used = Counter()
    ends: list[tuple[float | None, dict]] = []  # (seconds from now, need) of each job holding capacity
    for r in running:
        used.update(r.need)
        ends.append((remaining_s(r, now, typical_s), r.need))
    places, clock, unknown = [], 0.0, False
    for i, w in enumerate(order):
        if unknown:  # behind a start that cannot be estimated: none after it can be either
            places.append(Place(i + 1, len(order), None))
            continue
        while not _fits(w.need, used, capacity):
            known = [e[0] for e in ends if e[0] is not None]
            if not known:
                break
            clock = max(clock, min(known))  # the next end; every job ended by then frees its share
            for e in [e for e in ends if e[0] is not None and e[0] <= clock]:
                used.subtract(e[1])
                ends.remove(e)
        if not _fits(w.need, used, capacity):
            unknown = True
            places.append(Place(i + 1, len(order), None))
            continue
        places.append(Place(i + 1, len(order), clock))
        used.update(w.need)
        typical = (typical_s or {}).get(w.kind)
        ends.append((None if typical is None else clock + typical, w.need))
    return places


def job_fraction(phases: list[str], progress: dict) -> float | None:
    """How much of a job is done, from its progress: each of its `phases` (in order, of "sft", "rl",
    "eval") an equal share, the current one as far as its steps have gone (an eval's as started).
    None before the first progress report."""
    phase = progress.get("phase")
    if phase not in phases:
        return None
    i = phases.index(phase)
    total, done = progress.get("of"), progress.get("step", progress.get("env_steps"))
    within = min(1.0, max(0.0, done / total)) if isinstance(total, (int, float)) and total > 0 and \
        isinstance(done, (int, float)) else 0.0
    return (i + within) / len(phases)
