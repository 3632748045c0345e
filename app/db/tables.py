"""The tables of docs/billing.md, as SQLAlchemy models; their shape is a contract with billing jobs.

The Alembic revisions in ``migrations/`` create them; these models are how the app reads and writes.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    false,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    """A customer; its limits are None when unlimited."""

    __tablename__ = "tenants"
    __table_args__ = (
        # A deleted tenant keeps its row (and its name) for the usage rows that point at it.
        CheckConstraint("status IN ('active', 'disabled', 'deleted')", name="tenants_status_check"),
        CheckConstraint("fair_share_weight > 0", name="tenants_fair_share_weight_check"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(Text, unique=True)
    status: Mapped[str] = mapped_column(String(16), default="active", server_default="active")
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    # The tenant's share of the engine when tenants compete for it (the fair scheduler's weight).
    fair_share_weight: Mapped[float] = mapped_column(Float, default=1.0, server_default=text("1.0"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class ApiKey(Base):
    """A tenant's key: only its prefix and a keyed hash of the whole secret are stored.

    Its limits are None when only the tenant's apply; a limit set here narrows the tenant's for this key.
    """

    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(Text)
    prefix: Mapped[str] = mapped_column(String(32), index=True)
    secret_hash: Mapped[bytes] = mapped_column(LargeBinary, unique=True)
    scopes: Mapped[list[str]] = mapped_column(ARRAY(Text))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)


class Adapter(Base):
    """A tenant's LoRA adapter; its files are the ``adapter_files`` row of its digest (``storage_path``: a cache)."""

    __tablename__ = "adapters"
    __table_args__ = (
        CheckConstraint("status IN ('ready', 'failed', 'deleted')", name="adapters_status_check"),
        # A name is unique among a tenant's live adapters; deleted rows stay for the usage they explain.
        Index(
            "adapters_tenant_name_live", "tenant_id", "name", unique=True, postgresql_where=text("status <> 'deleted'")
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(Text)
    base_model: Mapped[str] = mapped_column(Text)
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[str]] = mapped_column(ARRAY(Text))
    digest: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    storage_path: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="ready", server_default="ready")
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """Kept resident in every replica's engine (an admin's pin); announced to replicas on change."""
    tool_call_format: Mapped[str | None] = mapped_column(String(32), nullable=True)
    """The format its tool calls are written and read in; None: the server's (LORAPLEX_TOOL_CALL_FORMAT)."""
    chat_template: Mapped[str | None] = mapped_column(Text, nullable=True, deferred=True)
    """Its own chat template (Jinja, checked at upload); None: the base model's. Read only by requests on it."""
    chat_template_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """sha256 of ``chat_template``: what compiled templates are cached by."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class AdapterFile(Base):
    """An adapter's two files, by content digest: the source of truth every replica's local cache fills from.

    ``bytea`` rather than large objects: plain ``pg_dump`` holds them with the rows, they come and go in
    the transaction that records the adapter, and nothing is left to ``lo_unlink``. A ``bytea`` value is
    at most 1 GB, above ``LORAPLEX_MAX_ADAPTER_MB`` (512 MiB by default); uploads are refused past that.
    """

    __tablename__ = "adapter_files"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    config: Mapped[bytes] = mapped_column(LargeBinary)
    weights: Mapped[bytes] = mapped_column(LargeBinary)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    """Bytes of the two files together."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class UsageEvent(Base):
    """One row per request that reached the engine (append-only; billing reads it)."""

    __tablename__ = "usage_events"
    __table_args__ = (
        CheckConstraint("status IN ('ok', 'error', 'cancelled')", name="usage_events_status_check"),
        Index("usage_events_tenant_started", "tenant_id", "started_at"),
        Index("usage_events_adapter_started", "adapter_id", "started_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    # Unique so that a batch retried after a lost commit acknowledgement never counts twice.
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    adapter_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("adapters.id"))
    model: Mapped[str] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    ttft_ms: Mapped[float | None] = mapped_column(Float)


class StoredResponse(Base):
    """A response of /v1/responses kept with ``store: true``: readable, continuable and deletable by its tenant only.

    ``input_items`` is the whole conversation the response was generated from (a continued response's holds
    the previous one's items and output before its own input), so neither reading nor continuing it walks a
    chain, and deleting one response never breaks another. Rows past ``expires_at`` are invisible and swept.
    """

    __tablename__ = "stored_responses"
    __table_args__ = (
        Index("stored_responses_tenant", "tenant_id"),
        Index("stored_responses_expires_at", "expires_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)
    response: Mapped[dict[str, Any]] = mapped_column(JSONB)
    """The response object as it was answered."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class AuditLog(Base):
    """Who changed what through the admin API, with the record before and after."""

    __tablename__ = "audit_log"
    __table_args__ = (Index("audit_log_at", "at"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    actor_key_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    # The actor key's tenant: the `admin` tenant's for a platform admin, its own for a tenant admin.
    actor_tenant_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    action: Mapped[str] = mapped_column(Text)
    target_type: Mapped[str] = mapped_column(Text)
    target_id: Mapped[str | None] = mapped_column(Text)
    before: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSONB)


USAGE_DAILY_VIEW = """
CREATE VIEW usage_daily AS
SELECT (started_at AT TIME ZONE 'UTC')::date AS day,
       tenant_id,
       adapter_id,
       model,
       count(*) AS requests,
       sum(prompt_tokens)::bigint AS prompt_tokens,
       sum(cached_prompt_tokens)::bigint AS cached_prompt_tokens,
       sum(completion_tokens)::bigint AS completion_tokens,
       count(*) FILTER (WHERE status = 'error') AS errors,
       count(*) FILTER (WHERE status = 'cancelled') AS cancelled
FROM usage_events
GROUP BY 1, 2, 3, 4
"""
"""The daily rollup per tenant, adapter and model (UTC days) that billing jobs read."""
