"""Usage rows, rolled up: one per tenant, kind, job and hour (its `at` the hour's start), which each
write adds to. The Meter writes four times a second; the table grows with the hours and the jobs
metered, not with its ticks. Helpers over an open write session of `vlamux.store.Store`."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from vlamux.store.models import JobRow, UsageRow

PERIOD_S = 3600.0
Sums = dict[tuple[str, str, str | None], float]  # (tenant, kind, job or None) -> amount


def add(s: Session, sums: Sums, now: float) -> None:
    """Add each amount to its row of the period holding `now`, or make the row. Usage naming a job no
    longer on record (pruned from the history since) is the tenant's. Added in SQL (amount = amount +
    x), so concurrent writers each add theirs; two that both make a new row make two, which sum the same."""
    jobs = {j for _, _, j in sums if j is not None}
    known = set(s.scalars(select(JobRow.id).where(JobRow.id.in_(jobs)))) if jobs else set()
    if known != jobs:
        folded: Sums = {}
        for (t, k, j), v in sums.items():
            key = (t, k, j if j in known else None)
            folded[key] = folded.get(key, 0.0) + v
        sums, jobs = folded, known
    _add_at(s, sums, now - now % PERIOD_S, jobs)


def fold_jobs(s: Session, tenant_id: str, job_ids: Iterable[str]) -> None:
    """The jobs' usage becomes the tenant's (no job named), period by period; their rows go."""
    job_ids = list(job_ids)
    for at, kind, total in s.execute(select(UsageRow.at, UsageRow.kind, func.sum(UsageRow.amount))
                                     .where(UsageRow.job_id.in_(job_ids)).group_by(UsageRow.at, UsageRow.kind)).all():
        _add_at(s, {(tenant_id, kind, None): float(total)}, at, set())
    s.execute(delete(UsageRow).where(UsageRow.job_id.in_(job_ids)))


def _add_at(s: Session, sums: Sums, at: float, jobs: set[str]) -> None:
    q = select(UsageRow.id, UsageRow.tenant_id, UsageRow.kind, UsageRow.job_id).where(
        UsageRow.at == at, UsageRow.tenant_id.in_({t for t, _, _ in sums}), UsageRow.kind.in_({k for _, k, _ in sums}),
        or_(UsageRow.job_id.in_(jobs), UsageRow.job_id.is_(None)))
    have: dict[tuple, int] = {}
    for rid, tenant_id, kind, job_id in s.execute(q):
        have.setdefault((tenant_id, kind, job_id), rid)
    for (tenant_id, kind, job_id), amount in sums.items():
        rid = have.get((tenant_id, kind, job_id))
        if rid is None:
            s.add(UsageRow(tenant_id=tenant_id, kind=kind, amount=amount, job_id=job_id, at=at))
        else:
            s.execute(update(UsageRow).where(UsageRow.id == rid).values(amount=UsageRow.amount + amount))
