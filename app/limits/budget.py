"""Monthly token budgets: tokens used in this calendar month (UTC), with ``usage_events`` as the record.

The one idea: what a tenant (or a key) used this month is read from ``usage_events`` once, the first time
a request needs it, and from then on the limits' store adds what is settled, plus what running requests
have reserved. Every request that reached the engine has exactly one usage row, so the sum holds across
restarts; it is read again when the month changes. In this process (memory_store.py) the running total
is a :class:`MonthUsage`; in Redis (redis_store.py) it is one counter per level and month that the first
replica to need it seeds from the same read.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from app.db.database import Database
from app.db.tables import UsageEvent
from app.web.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)

UsageLoader = Callable[[uuid.UUID, uuid.UUID | None, datetime, datetime], Awaitable[int]]
"""``(tenant_id, key_id or None, start, end)`` → tokens used in [start, end): by the key when one is given."""
ReadId = tuple[uuid.UUID, uuid.UUID | None, datetime]


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


class UsageReads:
    """One query for all the requests that need the same level's month at once.

    Requests that arrive while a read runs share it. With ``reuse_s`` above 0 a finished read also
    answers the requests that arrive within that many seconds (monotonic) of its end: the Redis store
    needs that, because a burst of first requests learns that the month is missing in several replies
    that do not all come back while the one read runs.
    """

    def __init__(self, load_usage: UsageLoader, *, reuse_s: float = 0.0) -> None:
        self._load_usage = load_usage
        self._reuse_s = reuse_s
        self._loading: dict[ReadId, asyncio.Task[int]] = {}
        self._recent: dict[ReadId, tuple[int, float]] = {}  # value, monotonic time it was read

    async def read(self, tenant_id: uuid.UUID, key_id: uuid.UUID | None, start: datetime, end: datetime) -> int:
        """Tokens used by the level in [start, end); raises what the loader raises (503 without a database)."""
        read_id = (tenant_id, key_id, start)
        if self._reuse_s > 0:
            now = time.monotonic()
            self._recent = {key: value for key, value in self._recent.items() if now - value[1] < self._reuse_s}
            if (recent := self._recent.get(read_id)) is not None:
                return recent[0]
        task = self._loading.get(read_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load_usage(tenant_id, key_id, start, end))
            self._loading[read_id] = task
            task.add_done_callback(partial(self._finish, read_id))
        # Shielded: a request that goes away does not cancel the query the others await.
        return await asyncio.shield(task)

    def _finish(self, read_id: ReadId, task: asyncio.Task[int]) -> None:
        self._loading.pop(read_id, None)
        if task.cancelled():
            return
        if task.exception() is None and self._reuse_s > 0:  # exception() also marks a failure retrieved
            self._recent[read_id] = (task.result(), time.monotonic())
