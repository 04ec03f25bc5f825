"""Persistent store of the tenant-facing service (tenants, API keys, jobs, checkpoints, usage)."""

from vlamux.store.store import (
    JOB_STATES,
    ApiKey,
    CheckpointRecord,
    JobEvent,
    JobRecord,
    Store,
    Tenant,
    UsageTotals,
    secret_digest,
)

__all__ = ["JOB_STATES", "ApiKey", "CheckpointRecord", "JobEvent", "JobRecord", "Store", "Tenant", "UsageTotals",
           "secret_digest"]
