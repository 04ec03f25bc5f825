"""ORM tables of the service store (SQLAlchemy 2 declarative).

Timestamps are float seconds since the epoch. These classes never leave
`store.py`: callers get frozen dataclasses, so no session state escapes.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Double, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, float: Double}


class TenantRow(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float]
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    quotas: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ApiKeyRow(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id"), index=True)  # NULL: admin key
    name: Mapped[str] = mapped_column(String(128), default="")
    secret_sha256: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    created_at: Mapped[float]
    revoked_at: Mapped[float | None]
    last_used_at: Mapped[float | None]


class JobRow(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(32))
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[float] = mapped_column(index=True)
    updated_at: Mapped[float]
    error: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict[str, Any] | None]
    progress: Mapped[dict[str, Any] | None]
    workdir: Mapped[str] = mapped_column(Text)


class SlotRow(Base):
    """A training slot a tenant drives step by step over the API (its own record, not a job's)."""
    __tablename__ = "training_slots"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[float] = mapped_column(index=True)
    updated_at: Mapped[float]
    error: Mapped[str | None] = mapped_column(Text)
    workdir: Mapped[str] = mapped_column(Text)


class JobEventRow(Base):
    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    at: Mapped[float]
    state: Mapped[str] = mapped_column(String(16))
    detail: Mapped[str] = mapped_column(Text, default="")


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), index=True)
    policy_id: Mapped[str] = mapped_column(Text)
    policy_version: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float]


class UsageRow(Base):
    __tablename__ = "usage_records"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    kind: Mapped[str] = mapped_column(String(64))
    amount: Mapped[float]
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"))
    at: Mapped[float]
    # usage_totals filters by tenant and time window
    __table_args__ = (Index("ix_usage_tenant_at", "tenant_id", "at"),)
