"""The usage writer gets every request's usage into ``usage_events`` exactly once, even across outages."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio.to_thread
import asyncpg
import pytest

from app.db.database import Database
from app.db.embedded import EmbeddedPostgres
from app.db.migrate import upgrade
from app.usage.records import UsageRecord
from app.usage.writer import UsageWriter

pytestmark = pytest.mark.anyio

WRITER_LOGGER = "app.usage.writer"


def _usage(tenant_id: uuid.UUID, request_id: str, index: int = 0) -> UsageRecord:
    started_at = datetime(2025, 3, 1, 12, 0, tzinfo=UTC) + timedelta(seconds=index, microseconds=index)
    return UsageRecord(
        request_id=request_id,
        tenant_id=tenant_id,
        api_key_id=None,
        adapter_id=None,
        model="SmolLM2-135M-Instruct",
        prompt_tokens=100 + index,
        cached_prompt_tokens=index % 64,
        completion_tokens=7 * index + 1,
        status=("ok", "error", "cancelled")[index % 3],
        finish_reason="length" if index % 2 else None,
        started_at=started_at,
        finished_at=started_at + timedelta(milliseconds=250 + index),
        ttft_ms=12.5 + index / 7 if index % 5 else None,
    )


async def _insert_tenant(url: str) -> uuid.UUID:
    tenant_id = uuid.uuid4()
    connection = await asyncpg.connect(url)
    try:
        await connection.execute("INSERT INTO tenants (id, name) VALUES ($1, $2)", tenant_id, f"tenant-{tenant_id}")
    finally:
        await connection.close()
    return tenant_id


async def _stored(url: str) -> list[UsageRecord]:
    """Every usage_events row, as the record it was written from."""
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch("SELECT * FROM usage_events ORDER BY request_id")
    finally:
        await connection.close()
    fields = UsageRecord.__struct_fields__
    return [UsageRecord(**{name: row[name] for name in fields}) for row in rows]


async def _wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


@pytest.fixture
def pgdata() -> Iterator[Path]:
    """A data folder for a private server, outside pytest's temp root: any pytest run that starts meanwhile
    makes that root 0700, which locks the server's system user out of its folder while it restarts."""
    with tempfile.TemporaryDirectory(prefix="loraplex-usage-writer-") as folder:
        yield Path(folder) / "pg"


@pytest.fixture
async def database(database_url: str) -> AsyncIterator[Database]:
    database = Database(database_url)
    yield database
    await database.close()


async def test_records_are_written_in_batches_and_round_trip(database: Database, database_url: str) -> None:
    tenant_id = await _insert_tenant(database_url)
    recorded = [_usage(tenant_id, f"req-{index:05d}", index) for index in range(1000)]
    # The interval is far longer than the test: only a full batch can trigger these writes.
    writer = UsageWriter(database, flush_interval_s=60.0, max_batch=500)
    writer.start()
    for rec in recorded:
        writer.record(rec)
    await _wait_until(lambda: writer.num_written == 1000, timeout_s=5.0)
    await writer.stop()
    assert writer.num_pending == 0
    assert await _stored(database_url) == recorded


async def test_a_request_id_recorded_twice_is_stored_once(
    database: Database, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    tenant_id = await _insert_tenant(database_url)
    writer = UsageWriter(database)
    first, retried = _usage(tenant_id, "req-same", 1), _usage(tenant_id, "req-same", 2)
    writer.record(first)
    writer.record(retried)  # in the same batch
    await writer.flush()
    writer.record(retried)  # in a later batch
    await writer.flush()
    assert writer.num_pending == 0
    assert await _stored(database_url) == [first]
    assert not [r for r in caplog.records if r.name == WRITER_LOGGER and r.levelno >= logging.WARNING]


async def test_an_outage_loses_nothing_and_counts_nothing_twice(pgdata: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=WRITER_LOGGER)
    server = EmbeddedPostgres(pgdata)
    url = await anyio.to_thread.run_sync(server.start)
    database = Database(url)
    try:
        await anyio.to_thread.run_sync(upgrade, url)
        tenant_id = await _insert_tenant(url)
        writer = UsageWriter(database, flush_interval_s=0.05)
        writer.start()
        before = [_usage(tenant_id, f"req-before-{index}", index) for index in range(20)]
        for rec in before:
            writer.record(rec)
        await _wait_until(lambda: writer.num_written == 20, timeout_s=5.0)

        await anyio.to_thread.run_sync(server.stop)
        during = [_usage(tenant_id, f"req-during-{index}", index) for index in range(30)]
        for rec in during:
            writer.record(rec)
        await asyncio.sleep(1.2)  # several failed attempts, with backoff
        assert writer.num_pending == 30

        server = EmbeddedPostgres(pgdata)
        assert await anyio.to_thread.run_sync(server.start) == url
        await _wait_until(lambda: writer.num_pending == 0, timeout_s=8.0)  # the background task recovers
        await writer.stop()
        assert await _stored(url) == sorted(before + during, key=lambda rec: rec.request_id)
        warnings = [r for r in caplog.records if r.name == WRITER_LOGGER and r.levelno == logging.WARNING]
        assert len(warnings) == 1, "one warning per outage, not one per retry"
        assert any("is back" in r.getMessage() and "wrote 30" in r.getMessage() for r in caplog.records)
    finally:
        await database.close()
        await anyio.to_thread.run_sync(server.stop)


async def test_records_spilled_at_shutdown_are_written_by_a_later_start(
    tmp_path: Path, database: Database, database_url: str
) -> None:
    tenant_id = await _insert_tenant(database_url)
    spill_path = tmp_path / "usage-spill.jsonl"
    recorded = [_usage(tenant_id, f"req-{index}", index) for index in range(7)]
    unreachable = Database(f"postgresql://postgres@/loraplex?host={tmp_path / 'no-server-here'}")
    try:
        writer = UsageWriter(unreachable, spill_path=spill_path)
        writer.start()
        for rec in recorded[:5]:
            writer.record(rec)
        await writer.stop(timeout_s=0.3)
        assert len(spill_path.read_bytes().splitlines()) == 5

        restarted_while_down = UsageWriter(unreachable, spill_path=spill_path)
        restarted_while_down.start()
        assert restarted_while_down.num_pending == 5
        for rec in recorded[5:]:
            restarted_while_down.record(rec)
        await restarted_while_down.stop(timeout_s=0.3)
        assert len(spill_path.read_bytes().splitlines()) == 7, "each record spilled once"
    finally:
        await unreachable.close()

    restarted = UsageWriter(database, spill_path=spill_path, flush_interval_s=0.05)
    restarted.start()
    assert restarted.num_pending == 7
    await _wait_until(lambda: restarted.num_pending == 0, timeout_s=5.0)
    await restarted.stop()
    assert await _stored(database_url) == recorded
    assert not spill_path.exists()


async def test_stop_without_a_spill_file_says_how_many_records_are_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    unreachable = Database(f"postgresql://postgres@/loraplex?host={tmp_path / 'no-server-here'}")
    writer = UsageWriter(unreachable)
    writer.start()
    for index in range(3):
        writer.record(_usage(uuid.uuid4(), f"req-{index}", index))
    await writer.stop(timeout_s=0.3)
    await unreachable.close()
    errors = [r.getMessage() for r in caplog.records if r.name == WRITER_LOGGER and r.levelno == logging.ERROR]
    assert any("3 records unwritten" in message for message in errors)


async def test_rows_the_database_refuses_are_dropped_and_the_rest_written(
    database: Database, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    tenant_id = await _insert_tenant(database_url)
    good = [_usage(tenant_id, f"req-good-{index}", index) for index in range(4)]
    unknown_tenant = _usage(uuid.uuid4(), "req-unknown-tenant")
    too_long_id = _usage(tenant_id, "req-" + "x" * 100)  # request_id is varchar(64)
    writer = UsageWriter(database)
    for rec in [good[0], unknown_tenant, good[1], good[2], too_long_id, good[3]]:
        writer.record(rec)
    assert await writer.flush() == 4
    assert writer.num_pending == 0
    assert await _stored(database_url) == good
    errors = [r.getMessage() for r in caplog.records if r.name == WRITER_LOGGER and r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert "req-unknown-tenant" in errors[0]
    assert too_long_id.request_id in errors[1]
