"""Persistent store of the tenant-facing service (tenants, API keys, jobs, training slots, checkpoints,
usage)."""

from vlamux.store.records import (
    JOB_STATES,
    SLOT_STATES,
    ApiKey,
    CheckpointRecord,
    JobEvent,
    JobRecord,
    SlotRecord,
    Tenant,
    UsageTotals,
    secret_digest,
)
from vlamux.store.store import Store

__all__ = ["JOB_STATES", "SLOT_STATES", "ApiKey", "CheckpointRecord", "JobEvent", "JobRecord", "SlotRecord", "Store",
           "Tenant", "UsageTotals", "secret_digest"]
