"""The usage writer: the request path hands it records; a background task inserts them in batches.

Nothing is lost because the database is away or the process dies: each record goes to the usage spool
(app/usage/spool.py), an fsync'd file the next start reads back, before its reply completes, and waits in
memory until the table holds it, retried with exponential backoff while the database is unreachable. A full
spool refuses new requests (:meth:`UsageWriter.check_room`) rather than serve what could not be billed. Only
rows the database itself refuses (SQLSTATE class 22, data exception, or 23, integrity violation, e.g. an
unknown tenant) are dropped, one by one, each with an error log. Retrying is safe because ``request_id`` is
UNIQUE and every INSERT says ON CONFLICT DO NOTHING: a batch retried after a lost commit acknowledgement never
counts twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import asyncpg
import msgspec

from app.db.database import Database
from app.db.tables import UsageEvent
from app.retry import Backoff
from app.settings import DEFAULT_USAGE_SPOOL_MAX_MB
from app.usage.records import UsageRecord
from app.usage.spool import UsageSpool
from app.web.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)

_COLUMNS = UsageRecord.__struct_fields__  # the record's fields are the table's columns, in this order
# One prepared statement, each row bound to it by asyncpg's executemany: atomic, one round trip a batch,
# on a connection the writer keeps, rather than SQLAlchemy's pool (checkout, pre-ping, BEGIN, the insert,
# COMMIT), which took several times the event loop's CPU a batch (docs/benchmarks.md#gateway-constants-and-choices).
INSERT_USAGE_SQL = (
    f"INSERT INTO {UsageEvent.__tablename__} ({', '.join(_COLUMNS)}) "
    f"VALUES ({', '.join(f'${number}' for number in range(1, len(_COLUMNS) + 1))}) "
    "ON CONFLICT (request_id) DO NOTHING"
)

INITIAL_BACKOFF_S = 0.2  # the first retry's longest wait while the database is away; doubled per failure (app/retry.py)
MAX_BACKOFF_S = 5.0
WRITE_TIMEOUT_S = 10.0  # one batch attempt; a database that hangs is treated like one that is down
CLOSE_TIMEOUT_S = 2.0
# How long a reply waits for its record to be on disk: past it the reply goes out and the record stays queued
# (a disk that hangs must not hang every reply; the spool's error refuses new requests meanwhile).
DURABLE_WAIT_S = 5.0
REJECTED_SQLSTATE_CLASSES = ("22", "23")  # data exception, integrity constraint violation


def _rejected_by_database(error: Exception) -> bool:
    """True when the database refused the rows themselves, so sending them again cannot succeed."""
    return isinstance(error, asyncpg.PostgresError) and str(error.sqlstate)[:2] in REJECTED_SQLSTATE_CLASSES


class UsageWriter:
    """Batches usage records into ``usage_events``; ``record()`` is all the request path sees."""

    def __init__(
        self,
        database: Database,
        *,
        spool_folder: Path | None = None,
        spool_stem: str = "usage-spool",
        spool_max_bytes: int = DEFAULT_USAGE_SPOOL_MAX_MB * 1024**2,
        flush_interval_s: float = 0.2,
        max_batch: int = 500,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._database = database
        self._spool = None if spool_folder is None else UsageSpool(spool_folder, spool_stem, max_bytes=spool_max_bytes)
        self._flush_interval_s = flush_interval_s
        self._max_batch = max_batch
        # (sequence number, record), oldest first; only the writer removes, from the left. Numbers grow along the
        # queue, so a written batch's last number releases every spooled record up to it.
        self._pending: deque[tuple[int, UsageRecord]] = deque()
        self._next_seq = 0
        self._record_lock = threading.Lock()  # a number and a place in the queue, taken together
        self._num_written = 0
        self._outage_since: float | None = None
        self._connection: asyncpg.Connection | None = None  # opened on the first write, again after a failure
        self._lock = asyncio.Lock()  # one writing pass at a time: the background task's or a flush()
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_written(self) -> int:
        """Records the table now holds (inserted, or already there under the same request_id)."""
        return self._num_written

    @property
    def spool_bytes(self) -> int:
        """Bytes of spooled records the table does not hold yet (0 without a spool)."""
        return 0 if self._spool is None else self._spool.num_bytes

    def check_room(self) -> None:
        """Raise a 503 when a new request's usage could not be kept: the spool is full or cannot be written."""
        if self._spool is None:
            return
        if self._spool.is_full:
            raise ServiceUnavailableError(
                "The server cannot record usage right now (its usage database is unreachable and the local spool "
                "is full), so it takes no new request; retry later."
            )
        if self._spool.error is not None:
            raise ServiceUnavailableError(
                "The server cannot record usage right now (its usage spool cannot be written), so it takes no "
                "new request; retry later."
            )

    def record(self, rec: UsageRecord) -> concurrent.futures.Future[None]:
        """Queue one record; never blocks and never raises (callable from any thread).

        The future is done once the record is durable: on disk in the spool, or in the table. Await it with
        :func:`wait_durable` before the reply completes.
        """
        with self._record_lock:
            seq = self._next_seq
            self._next_seq += 1
            self._pending.append((seq, rec))
            durable = self._spool.append(seq, rec) if self._spool is not None and self._loop is not None else None
        if durable is None:  # no spool, or not started: the record waits in memory (start() spools it)
            durable = concurrent.futures.Future()
            durable.set_result(None)
        if len(self._pending) == self._max_batch and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closing: the record waits for stop()
                self._loop.call_soon_threadsafe(self._wakeup.set)
        return durable

    def start(self) -> None:
        """Read the spool's records back, queue them, and start writing (call it inside the running event loop)."""
        if self._spool is not None:
            with self._record_lock:
                recorded_before = list(self._pending)
                replayed = self._spool.open(self._next_seq)
                self._next_seq += len(replayed)
                self._pending.extend(replayed)
                self._loop = asyncio.get_running_loop()
                for seq, rec in recorded_before:
                    self._spool.append(seq, rec)
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="usage-writer")

    async def flush(self) -> int:
        """Write what is pending now; returns how many records were written (fewer while the database is away)."""
        num_written, _ = await self._write_pending()
        return num_written

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the background task and write what is pending for up to ``timeout_s``; the spool keeps the rest."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._task = None
        backoff = Backoff(INITIAL_BACKOFF_S, MAX_BACKOFF_S)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self._pending:
                    if not (await self._write_pending())[1]:
                        await backoff.wait()
        self._loop = None
        if self._spool is not None:
            await asyncio.to_thread(self._spool.close)
        elif self._pending:
            logger.error("usage writer stopped with %d records unwritten and no spool: lost", len(self._pending))
        await self._close_connection()

    async def _run(self) -> None:
        backoff = Backoff(INITIAL_BACKOFF_S, MAX_BACKOFF_S)
        while True:
            if self._outage_since is None:
                backoff.reset()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), self._flush_interval_s)
            else:
                await backoff.wait()
            self._wakeup.clear()
            await self._write_pending()

    async def _write_pending(self) -> tuple[int, bool]:
        """Write the records pending now, batch by batch: (how many were written, whether the database took them).

        Records that arrive meanwhile wait for the next pass: under load, a pass that chased them would go
        on inserting a record or two at a time, a transaction each, on the request path's event loop.
        """
        num_written = 0
        async with self._lock:
            num_left = len(self._pending)
            while num_left:
                batch = [rec for _, rec in itertools.islice(self._pending, min(self._max_batch, num_left))]
                try:
                    async with asyncio.timeout(WRITE_TIMEOUT_S):
                        num_written += await self._insert(batch)
                except asyncio.CancelledError:
                    self._drop_connection()  # a write cut short leaves it in an unknown state
                    raise
                except Exception as error:  # the database is away (or worse): keep everything, retry later
                    self._drop_connection()
                    self._note_outage(error)
                    self._num_written += num_written
                    return num_written, False
                self._settle(len(batch))
                num_left -= len(batch)
            self._num_written += num_written
            if self._outage_since is not None:
                outage_s = time.monotonic() - self._outage_since
                logger.info("usage database is back after %.1f s; wrote %d held records", outage_s, num_written)
                self._outage_since = None
        return num_written, True

    async def _insert(self, batch: list[UsageRecord]) -> int:
        """Insert a batch in one statement; if the database refuses it, insert row by row and drop the refused."""
        try:
            await self._execute([msgspec.structs.astuple(rec) for rec in batch])
            return len(batch)
        except asyncpg.PostgresError as error:
            if not _rejected_by_database(error):
                raise
            logger.warning("the database refused a batch of %d usage records; retrying them one by one", len(batch))
        num_inserted = 0
        for rec in batch:
            try:
                await self._execute([msgspec.structs.astuple(rec)])
            except asyncpg.PostgresError as error:
                if not _rejected_by_database(error):
                    raise
                logger.error("dropped usage record %s: the database refused it: %s", rec.request_id, error)
                continue
            num_inserted += 1
        return num_inserted

    async def _execute(self, rows: list[tuple[Any, ...]]) -> None:
        if self._connection is None or self._connection.is_closed():
            self._connection = await self._database.connect_driver()
        await self._connection.executemany(INSERT_USAGE_SQL, rows)

    def _drop_connection(self) -> None:
        if self._connection is not None:
            self._connection.terminate()
            self._connection = None

    async def _close_connection(self) -> None:
        if self._connection is None:
            return
        try:
            await self._connection.close(timeout=CLOSE_TIMEOUT_S)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):  # the database went away
            self._connection.terminate()
        self._connection = None

    def _settle(self, num_records: int) -> None:
        """Take the first ``num_records`` off the queue: the table holds them, so the spool may let them go."""
        seq = -1
        for _ in range(num_records):
            seq, _ = self._pending.popleft()
        if self._spool is not None and seq >= 0:
            self._spool.release(seq)

    def _note_outage(self, error: Exception) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            logger.warning("usage database unavailable (%r); keeping %d records, retrying", error, len(self._pending))
        else:
            logger.debug("usage database still unavailable: %r", error)


async def wait_durable(durable: concurrent.futures.Future[None]) -> None:
    """Wait until a recorded usage is durable, for up to DURABLE_WAIT_S (it stays queued either way)."""
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(durable)), DURABLE_WAIT_S)
    except TimeoutError:
        logger.warning(
            "a usage record was not on disk after %.0f s; the reply goes out, the record stays queued", DURABLE_WAIT_S
        )
