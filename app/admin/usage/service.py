"""Usage reports for billing: the ``usage_daily`` view per UTC day, tenant and adapter, with their names."""

from __future__ import annotations

import csv
import dataclasses
import io
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from enum import StrEnum

import msgspec
from sqlalchemy import BigInteger, Date, Text, column, select, table
from sqlalchemy.dialects.postgresql import UUID

from app.db.database import Database
from app.db.tables import Adapter, Tenant
from app.web.errors import BadRequestError

DEFAULT_DAYS = 30  # a report with no dates covers the last 30 days, today included
DATE_PATTERN = re.compile(r"\d{4}-\d{2}-\d{2}")  # date.fromisoformat alone also takes 20261101 and 2026-W44-1
MAX_DAYS = 366  # a year, leap years included: bounds what one request makes the database scan

usage_daily = table(
    "usage_daily",
    column("day", Date),
    column("tenant_id", UUID(as_uuid=True)),
    column("adapter_id", UUID(as_uuid=True)),
    column("model", Text),
    column("requests", BigInteger),
    column("prompt_tokens", BigInteger),
    column("cached_prompt_tokens", BigInteger),
    column("completion_tokens", BigInteger),
    column("errors", BigInteger),
    column("cancelled", BigInteger),
)
"""The view of ``app.db.tables.USAGE_DAILY_VIEW`` (created by the first migration), for queries."""


class UsageFormat(StrEnum):
    JSON = "json"
    CSV = "csv"


class UsageRow(msgspec.Struct):
    """One UTC day of one tenant's requests to one model (``adapter_id`` None: the base model)."""

    day: date
    tenant_id: uuid.UUID
    tenant_name: str
    adapter_id: uuid.UUID | None
    adapter_name: str | None
    model: str
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    errors: int
    cancelled: int


class UsageReport(msgspec.Struct):
    """The rows of the days from ``start`` to ``end``, both included, by day, tenant name and model."""

    data: list[UsageRow]
    start: date
    end: date


USAGE_COLUMNS = UsageRow.__struct_fields__


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """Which usage to report, checked: ``start <= end`` and at most MAX_DAYS days."""

    start: date
    end: date
    tenant_id: uuid.UUID | None = None
    adapter_id: uuid.UUID | None = None
    format: UsageFormat = UsageFormat.JSON

    @classmethod
    def parse(cls, params: Mapping[str, str | None], today: date | None = None) -> UsageQuery:
        """The query from the request's parameters; BadRequestError naming the first one that is wrong.

        ``end`` defaults to today (UTC) and ``start`` to DEFAULT_DAYS days up to ``end``.
        """
        requested_format = params.get("format")
        if requested_format is None:
            requested_format = UsageFormat.JSON
        try:
            output_format = UsageFormat(requested_format)
        except ValueError:
            raise BadRequestError(f"format must be json or csv, got {requested_format!r}.", param="format") from None
        end = _date(params, "end") or today or datetime.now(UTC).date()
        start = _date(params, "start") or end - timedelta(days=DEFAULT_DAYS - 1)
        if start > end:
            raise BadRequestError(f"start ({start}) is after end ({end}); give start <= end.", param="start")
        num_days = (end - start).days + 1
        if num_days > MAX_DAYS:
            raise BadRequestError(
                f"The range from start ({start}) to end ({end}) covers {num_days} days; ask for at most {MAX_DAYS} "
                "at a time.",
                param="start",
            )
        return cls(
            start=start,
            end=end,
            tenant_id=_uuid(params, "tenant_id"),
            adapter_id=_uuid(params, "adapter_id"),
            format=output_format,
        )

    def within(self, tenant_scope: uuid.UUID | None) -> UsageQuery:
        """This query narrowed to ``tenant_scope``'s rows (a tenant admin's own tenant); None leaves it as is."""
        return self if tenant_scope is None else dataclasses.replace(self, tenant_id=tenant_scope)


async def usage_report(database: Database, query: UsageQuery) -> UsageReport:
    """The usage rows the query asks for, with the names of their tenants and adapters."""
    statement = (
        select(
            usage_daily.c.day,
            usage_daily.c.tenant_id,
            Tenant.name.label("tenant_name"),
            usage_daily.c.adapter_id,
            Adapter.name.label("adapter_name"),
            usage_daily.c.model,
            usage_daily.c.requests,
            usage_daily.c.prompt_tokens,
            usage_daily.c.cached_prompt_tokens,
            usage_daily.c.completion_tokens,
            usage_daily.c.errors,
            usage_daily.c.cancelled,
        )
        .join(Tenant, Tenant.id == usage_daily.c.tenant_id)
        .outerjoin(Adapter, Adapter.id == usage_daily.c.adapter_id)
        .where(usage_daily.c.day >= query.start, usage_daily.c.day <= query.end)
        # adapter_id last: a replaced adapter keeps its name, so one model name can have two adapters a day
        .order_by(usage_daily.c.day, Tenant.name, usage_daily.c.model, usage_daily.c.adapter_id.nulls_first())
    )
    if query.tenant_id is not None:
        statement = statement.where(usage_daily.c.tenant_id == query.tenant_id)
    if query.adapter_id is not None:
        statement = statement.where(usage_daily.c.adapter_id == query.adapter_id)
    async with database.sessions() as session:
        result = await session.execute(statement)
        rows = [UsageRow(**row._asdict()) for row in result]
    return UsageReport(data=rows, start=query.start, end=query.end)


def usage_csv(report: UsageReport) -> str:
    """The report as CSV: a header line of USAGE_COLUMNS, then one line per row (None as an empty field)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(USAGE_COLUMNS)
    for row in report.data:
        writer.writerow(["" if value is None else value for value in msgspec.structs.astuple(row)])
    return buffer.getvalue()


def usage_filename(query: UsageQuery) -> str:
    return f"usage-{query.start}-{query.end}.{query.format}"


def _date(params: Mapping[str, str | None], name: str) -> date | None:
    value = params.get(name)
    if value is None:
        return None
    try:
        if DATE_PATTERN.fullmatch(value) is None:
            raise ValueError(value)
        return date.fromisoformat(value)
    except ValueError:
        raise BadRequestError(f"{name} must be a date as YYYY-MM-DD, got {value!r}.", param=name) from None


def _uuid(params: Mapping[str, str | None], name: str) -> uuid.UUID | None:
    value = params.get(name)
    if value is None:
        return None
    try:
        return uuid.UUID(value)
    except ValueError:
        raise BadRequestError(f"{name} must be a UUID, got {value!r}.", param=name) from None
