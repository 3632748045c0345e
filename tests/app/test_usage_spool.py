"""The usage spool on its own: appends fsync'd, released lines cut out of the file, growth logged, read back."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import pytest

from app.usage.spool import GROWTH_LOG_FIRST_BYTES, UsageSpool
from tests.app.usage_records import usage_record

WAIT_S = 30.0
SPOOL_LOGGER = "app.usage.spool"


def _file_bytes(folder: Path) -> int:
    return (folder / "usage-spool.jsonl").stat().st_size


def test_released_lines_leave_the_file_and_the_rest_is_read_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tenant_id = uuid.uuid4()
    spool = UsageSpool(tmp_path, "usage-spool", max_bytes=64 * 1024**2)
    assert spool.open(first_seq=0) == []
    records = [usage_record(tenant_id, f"req-{index:06d}", index) for index in range(12_000)]  # some 4.5 MiB
    # In groups of 1,000 (some 0.4 MiB), each durable before the next: the writer's batches stay under 1 MiB, so
    # each of 1, 2 and 4 MiB is passed by a batch of its own (a batch that passes two logs once).
    for first in range(0, len(records), 1_000):
        group = range(first, first + 1_000)
        for durable in [spool.append(seq, records[seq]) for seq in group]:
            durable.result(WAIT_S)
    written = _file_bytes(tmp_path)
    assert written == spool.num_bytes > 4 * GROWTH_LOG_FIRST_BYTES
    growth = [r.getMessage() for r in caplog.records if r.name == SPOOL_LOGGER and r.levelno == logging.WARNING]
    assert len(growth) == 3, "a warning at 1, 2 and 4 MiB"

    spool.release(8_999)  # three quarters are in the table: the file is rewritten with the last quarter
    spool.append(len(records), records[0]).result(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while _file_bytes(tmp_path) > written / 3:
        assert time.monotonic() < deadline, "the released lines are still in the file"
        time.sleep(0.01)
    spool.close()

    reopened = UsageSpool(tmp_path, "usage-spool", max_bytes=64 * 1024**2)
    replayed = reopened.open(first_seq=100)
    assert [rec for _, rec in replayed] == [*records[9_000:], records[0]]
    assert [seq for seq, _ in replayed] == list(range(100, 100 + len(replayed)))
    reopened.release(100 + len(replayed) - 1)
    reopened.close()
    assert _file_bytes(tmp_path) == 0


def test_a_torn_last_line_and_repeated_ids_are_dropped_at_read_back(tmp_path: Path) -> None:
    tenant_id = uuid.uuid4()
    spool = UsageSpool(tmp_path, "usage-spool", max_bytes=1024**2)
    spool.open(first_seq=0)
    for seq, rec in enumerate([usage_record(tenant_id, "req-a"), usage_record(tenant_id, "req-b")]):
        spool.append(seq, rec).result(WAIT_S)
    spool.append(2, usage_record(tenant_id, "req-a", 5)).result(WAIT_S)  # a request id spooled twice
    spool.close()
    with (tmp_path / "usage-spool.jsonl").open("ab") as file:
        file.write(b'{"request_id": "req-c", "tenant')  # a crash in the middle of a write
    reopened = UsageSpool(tmp_path, "usage-spool", max_bytes=1024**2)
    assert [rec.request_id for _, rec in reopened.open(first_seq=0)] == ["req-a", "req-b"]
    reopened.close()
    assert len((tmp_path / "usage-spool.jsonl").read_bytes().splitlines()) == 2, "the file as read back"
