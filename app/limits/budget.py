"""Monthly token budgets: tokens used in this calendar month (UTC), with ``usage_events`` as the record.

The one idea: what a tenant (or a key) used this month is read from ``usage_events`` once, the first time
a request needs it, and from then on this process adds what it settles itself, plus what its running
requests have reserved. Every request that reached the engine has exactly one usage row, so the sum
holds across restarts; it is read again when the month changes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from app.db.database import Database
from app.db.tables import UsageEvent
from app.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)

UsageLoader = Callable[[uuid.UUID, uuid.UUID | None, datetime, datetime], Awaitable[int]]
"""``(tenant_id, key_id or None, start, end)`` → tokens used in [start, end): by the key when one is given."""


def month_bounds(now: datetime) -> tuple[datetime, datetime]:
    """The first instants of ``now``'s calendar month (UTC) and of the next one."""
    now = now.astimezone(UTC)
    start = datetime(now.year, now.month, 1, tzinfo=UTC)
    end = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    return start, end


@dataclass(slots=True)
class MonthUsage:
    """Tokens one tenant or key used in the month that starts at ``start``."""

    start: datetime
    num_recorded: int
    """From ``usage_events`` when this process first needed it."""
    num_settled: int = 0
    """Settled by this process's requests since then (their usage rows are written, or on their way)."""
    num_reserved: int = 0
    """Held by this process's running requests: prompt plus ``max_tokens`` each."""

    @property
    def num_used(self) -> int:
        return self.num_recorded + self.num_settled + self.num_reserved


def usage_loader(database: Database) -> UsageLoader:
    """The loader that sums prompt and completion tokens of ``usage_events`` (the tenant-and-time index serves it).

    It raises ServiceUnavailableError (503) when the database does not answer.
    """

    async def load(tenant_id: uuid.UUID, key_id: uuid.UUID | None, start: datetime, end: datetime) -> int:
        statement = select(func.coalesce(func.sum(UsageEvent.prompt_tokens + UsageEvent.completion_tokens), 0)).where(
            UsageEvent.tenant_id == tenant_id, UsageEvent.started_at >= start, UsageEvent.started_at < end
        )
        if key_id is not None:
            statement = statement.where(UsageEvent.api_key_id == key_id)
        try:
            async with database.engine.connect() as connection:
                return int((await connection.execute(statement)).scalar_one())
        except (SQLAlchemyError, OSError) as error:
            logger.warning("could not read the month's token usage of tenant %s: %s", tenant_id, error)
            raise ServiceUnavailableError(
                "The monthly token budget could not be checked because the database is unavailable; retry in a "
                "few seconds."
            ) from error

    return load
