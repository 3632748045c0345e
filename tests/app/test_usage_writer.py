"""The usage writer gets every request's usage into ``usage_events`` exactly once, even across outages."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import anyio.to_thread
import asyncpg
import msgspec
import pytest

from app.db.database import Database
from app.db.embedded import EmbeddedPostgres
from app.db.migrate import upgrade
from app.usage.records import UsageRecord
from app.usage.writer import UsageWriter, wait_durable
from app.web.errors import ServiceUnavailableError
from tests.app.usage_records import usage_record
from tests.app.usage_spool_child import DURABLE_LINE

pytestmark = pytest.mark.anyio

WRITER_LOGGER = "app.usage.writer"


_usage = usage_record


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


def _unreachable(folder: Path) -> Database:
    return Database(f"postgresql://postgres@/loraplex?host={folder / 'no-server-here'}")


def _spool_lines(folder: Path) -> list[bytes]:
    return (folder / "usage-spool.jsonl").read_bytes().splitlines()


async def test_records_the_database_did_not_take_are_written_by_a_later_start(
    tmp_path: Path, database: Database, database_url: str
) -> None:
    tenant_id = await _insert_tenant(database_url)
    recorded = [_usage(tenant_id, f"req-{index}", index) for index in range(7)]
    unreachable = _unreachable(tmp_path)
    try:
        writer = UsageWriter(unreachable, spool_folder=tmp_path)
        writer.start()
        for rec in recorded[:5]:
            writer.record(rec)
        await writer.stop(timeout_s=0.3)
        assert len(_spool_lines(tmp_path)) == 5

        restarted_while_down = UsageWriter(unreachable, spool_folder=tmp_path)
        restarted_while_down.start()
        assert restarted_while_down.num_pending == 5
        for rec in recorded[5:]:
            restarted_while_down.record(rec)
        await restarted_while_down.stop(timeout_s=0.3)
        assert len(_spool_lines(tmp_path)) == 7, "each record spooled once"
    finally:
        await unreachable.close()

    restarted = UsageWriter(database, spool_folder=tmp_path, flush_interval_s=0.05)
    restarted.start()
    assert restarted.num_pending == 7
    await _wait_until(lambda: restarted.num_pending == 0, timeout_s=5.0)
    await _wait_until(lambda: restarted.spool_bytes == 0, timeout_s=5.0)
    await restarted.stop()
    assert await _stored(database_url) == recorded
    assert _spool_lines(tmp_path) == [], "the spool keeps only what the table does not hold"


async def test_records_survive_a_killed_process_and_arrive_exactly_once(
    tmp_path: Path, database: Database, database_url: str
) -> None:
    """Records made durable while PostgreSQL is away, then SIGKILL: the next start writes each exactly once,
    also those the table already held (a commit whose release never reached the spool)."""
    tenant_id = await _insert_tenant(database_url)
    num_records = 40
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.app.usage_spool_child",
        str(tmp_path),
        str(tenant_id),
        str(num_records),
        stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert child.stdout is not None
        async with asyncio.timeout(60.0):
            line = await child.stdout.readline()
        assert line.decode().strip() == DURABLE_LINE
    finally:
        child.send_signal(signal.SIGKILL)
        await child.wait()
    recorded = [_usage(tenant_id, f"req-killed-{index}", index) for index in range(num_records)]
    already_written = UsageWriter(database)
    for rec in recorded[:10]:
        already_written.record(rec)
    assert await already_written.flush() == 10

    restarted = UsageWriter(database, spool_folder=tmp_path, flush_interval_s=0.05)
    restarted.start()
    assert restarted.num_pending == num_records
    await _wait_until(lambda: restarted.num_pending == 0, timeout_s=10.0)
    await restarted.stop()
    assert await _stored(database_url) == sorted(recorded, key=lambda rec: rec.request_id)


async def test_a_full_spool_refuses_new_requests_until_the_database_takes_it(
    tmp_path: Path, database: Database, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    tenant_id = await _insert_tenant(database_url)
    line_bytes = len(msgspec.json.encode(_usage(tenant_id, "req-00", 0))) + 1
    unreachable = _unreachable(tmp_path)
    recorded: list[UsageRecord] = []
    try:
        writer = UsageWriter(unreachable, spool_folder=tmp_path, spool_max_bytes=3 * line_bytes)
        writer.start()
        for index in range(3):
            writer.check_room()
            recorded.append(_usage(tenant_id, f"req-{index:02d}", index))
            await wait_durable(writer.record(recorded[-1]))
        with pytest.raises(ServiceUnavailableError, match="spool is full"):
            writer.check_room()
        recorded.append(_usage(tenant_id, "req-03", 3))  # a request already running still records its usage
        await wait_durable(writer.record(recorded[-1]))
        await writer.stop(timeout_s=0.3)
    finally:
        await unreachable.close()
    assert len(_spool_lines(tmp_path)) == 4
    assert any("full, new requests are refused" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)

    restarted = UsageWriter(database, spool_folder=tmp_path, spool_max_bytes=3 * line_bytes, flush_interval_s=0.05)
    restarted.start()
    await _wait_until(lambda: restarted.spool_bytes == 0, timeout_s=5.0)
    restarted.check_room()
    await restarted.stop()
    assert await _stored(database_url) == recorded


async def test_two_writers_on_one_data_folder_keep_spools_of_their_own(tmp_path: Path) -> None:
    unreachable = _unreachable(tmp_path)
    first, second = UsageWriter(unreachable, spool_folder=tmp_path), UsageWriter(unreachable, spool_folder=tmp_path)
    try:
        first.start()
        second.start()
        await wait_durable(first.record(_usage(uuid.uuid4(), "req-first")))
        await wait_durable(second.record(_usage(uuid.uuid4(), "req-second")))
        await first.stop(timeout_s=0.1)
        await second.stop(timeout_s=0.1)
    finally:
        await unreachable.close()
    assert [b"req-first" in line for line in _spool_lines(tmp_path)] == [True]
    assert [b"req-second" in line for line in (tmp_path / "usage-spool-1.jsonl").read_bytes().splitlines()] == [True]


async def test_stop_without_a_spool_says_how_many_records_are_lost(
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
