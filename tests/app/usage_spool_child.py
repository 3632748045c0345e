"""A process that records usage while PostgreSQL is unreachable, says so once every record is durable, and
waits to be killed: ``python -m tests.app.usage_spool_child SPOOL_FOLDER TENANT_ID NUM_RECORDS``."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

from app.db.database import Database
from app.usage.records import UsageRecord
from app.usage.writer import UsageWriter, wait_durable
from tests.app.usage_records import usage_record

DURABLE_LINE = "durable"


async def _record_and_wait(spool_folder: Path, tenant_id: uuid.UUID, num_records: int) -> None:
    unreachable = Database(f"postgresql://postgres@/loraplex?host={spool_folder / 'no-server-here'}")
    writer = UsageWriter(unreachable, spool_folder=spool_folder, flush_interval_s=0.05)
    writer.start()
    records: list[UsageRecord] = [usage_record(tenant_id, f"req-killed-{i}", i) for i in range(num_records)]
    for durable in [writer.record(rec) for rec in records]:
        await wait_durable(durable)
    sys.stdout.write(DURABLE_LINE + "\n")
    sys.stdout.flush()
    await asyncio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    asyncio.run(_record_and_wait(Path(sys.argv[1]), uuid.UUID(sys.argv[2]), int(sys.argv[3])))
