"""The usage page's rows: per UTC day and per tenant, key or adapter, with error rates and latency.

Read from ``usage_events`` (one row per request that reached the engine), so the three groupings add up to
the same totals as ``GET /admin/usage``. Latency comes from the same measurements as the gateway's metrics:
time to first token (``ttft_ms``, the ``loraplex_time_to_first_token_seconds`` histogram's samples) and the
whole request (``finished_at - started_at``), as medians and 95th percentiles of the day.
"""

from __future__ import annotations

import csv
import io
from dataclasses import astuple, dataclass, fields
from datetime import date, timedelta
from enum import StrEnum

from sqlalchemy import Date, Float, cast, func, literal, select
from sqlalchemy.sql.elements import ColumnElement

from app.admin.usage.service import UsageQuery
from app.db.database import Database
from app.db.tables import Adapter, ApiKey, Tenant, UsageEvent


class UsageGroup(StrEnum):
    TENANT = "tenant"
    KEY = "key"
    ADAPTER = "adapter"


@dataclass(frozen=True, slots=True)
class ConsoleUsageRow:
    """One day of one tenant, key or adapter (``group``: its label)."""

    day: date
    tenant: str
    group: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    errors: int
    cancelled: int
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    latency_p50_ms: float | None
    latency_p95_ms: float | None


CSV_COLUMNS = tuple(field.name for field in fields(ConsoleUsageRow))


def _group_label(group: UsageGroup) -> tuple[ColumnElement[str], list[ColumnElement]]:
    """The label column of a grouping and the columns to group by."""
    if group is UsageGroup.KEY:
        label = func.coalesce(ApiKey.name + literal(" (") + ApiKey.prefix + literal(")"), literal("(deleted key)"))
        return label, [UsageEvent.api_key_id, ApiKey.name, ApiKey.prefix]
    if group is UsageGroup.ADAPTER:
        label = func.coalesce(Adapter.name, UsageEvent.model + literal(" (base model)"))
        return label, [UsageEvent.adapter_id, Adapter.name, UsageEvent.model]
    return Tenant.name, []


async def usage_rows(database: Database, query: UsageQuery, group: UsageGroup) -> list[ConsoleUsageRow]:
    """Rows of the days from ``query.start`` to ``query.end`` (UTC, both included), by day, tenant and label."""
    day = cast(func.timezone("UTC", UsageEvent.started_at), Date)
    label, group_columns = _group_label(group)
    duration_ms = func.extract("epoch", UsageEvent.finished_at - UsageEvent.started_at) * 1000.0
    statement = (
        select(
            day.label("day"),
            Tenant.name.label("tenant"),
            label.label("group"),
            func.count().label("requests"),
            func.coalesce(func.sum(UsageEvent.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(UsageEvent.completion_tokens), 0).label("completion_tokens"),
            func.count().filter(UsageEvent.status == "error").label("errors"),
            func.count().filter(UsageEvent.status == "cancelled").label("cancelled"),
            func.percentile_cont(0.5).within_group(UsageEvent.ttft_ms).label("ttft_p50_ms"),
            func.percentile_cont(0.95).within_group(UsageEvent.ttft_ms).label("ttft_p95_ms"),
            func.percentile_cont(0.5).within_group(cast(duration_ms, Float)).label("latency_p50_ms"),
            func.percentile_cont(0.95).within_group(cast(duration_ms, Float)).label("latency_p95_ms"),
        )
        .join(Tenant, Tenant.id == UsageEvent.tenant_id)
        .outerjoin(ApiKey, ApiKey.id == UsageEvent.api_key_id)
        .outerjoin(Adapter, Adapter.id == UsageEvent.adapter_id)
        .where(day >= query.start, day <= query.end)
        .group_by(day, Tenant.id, Tenant.name, *group_columns)
        .order_by(day, Tenant.name, label)
    )
    if query.tenant_id is not None:
        statement = statement.where(UsageEvent.tenant_id == query.tenant_id)
    async with database.sessions() as session:
        result = await session.execute(statement)
        return [ConsoleUsageRow(**row._asdict()) for row in result]


def usage_csv(rows: list[ConsoleUsageRow]) -> str:
    """The rows as CSV: a header line of CSV_COLUMNS, then one line per row (None as an empty field)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow(["" if value is None else _csv_value(value) for value in astuple(row)])
    return buffer.getvalue()


def _csv_value(value: object) -> object:
    """Rounded latencies; text that a spreadsheet would run as a formula gets a leading quote (CSV injection)."""
    if isinstance(value, float):
        return round(value, 1)
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def chart_series(rows: list[ConsoleUsageRow], start: date, end: date) -> dict[str, object]:
    """The charts' data: every day from ``start`` to ``end`` (zero where nothing ran), tokens in and out per day,
    and requests per day for each label shown."""
    days = [start + timedelta(days=offset) for offset in range((end - start).days + 1)]
    position = {day: index for index, day in enumerate(days)}
    prompt = [0] * len(days)
    completion = [0] * len(days)
    requests: dict[str, list[int]] = {}
    for row in rows:
        index = position[row.day]
        prompt[index] += row.prompt_tokens
        completion[index] += row.completion_tokens
        key = row.group if row.group == row.tenant else f"{row.tenant} / {row.group}"
        requests.setdefault(key, [0] * len(days))[index] += row.requests
    return {
        "days": [day.isoformat() for day in days],
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "requests": requests,
    }
