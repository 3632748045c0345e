"""The background task that deletes stored responses past their retention, once at start and then hourly.

Every replica runs one; the delete is idempotent, so they need no coordination. A sweep the database cannot
take is logged and tried again at the next interval (expired responses are invisible meanwhile: reads filter
on ``expires_at``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sqlalchemy.exc import SQLAlchemyError

from app.openai.responses.storage import ResponseStore

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 3600.0  # retention is counted in days; an hour late is 0.14 % of the shortest


class ResponseSweeper:
    def __init__(self, store: ResponseStore, interval_s: float = SWEEP_INTERVAL_S) -> None:
        self._store = store
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="response-sweeper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                num_deleted = await self._store.sweep()
            except (SQLAlchemyError, OSError) as error:
                logger.warning(
                    "sweeping expired stored responses failed (%s); trying again in %.0f s", error, self._interval_s
                )
            else:
                if num_deleted:
                    logger.info("swept %d stored response(s) past their retention", num_deleted)
            await asyncio.sleep(self._interval_s)
