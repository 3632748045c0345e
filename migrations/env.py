"""Alembic's entry point: runs the revisions over one asyncpg connection.

Gateways started together on an empty database each upgrade it at start: the revisions run in one
transaction that first takes a PostgreSQL advisory lock, so one gateway migrates while the others wait,
then find the schema at head and apply nothing.
"""

import asyncio

from alembic import context
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from app.db.database import async_url
from app.db.tables import Base

target_metadata = Base.metadata
MIGRATION_LOCK_KEY = 0x6C6F7261706C6578  # "loraplex": the advisory lock every migrating gateway takes


def _record_applied(*, step, **_) -> None:
    """List each revision applied where app.db.migrate.upgrade reads them (when it is the caller)."""
    applied = context.config.attributes.get("applied_revisions")
    if applied is not None:
        applied.extend(step.up_revision_ids)


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, on_version_apply=_record_applied)
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        context.run_migrations()  # reads the schema's revision once the lock is held


async def _run_online(url: str) -> None:
    engine = create_async_engine(async_url(url))
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
    finally:
        await engine.dispose()


url = context.config.attributes.get("database_url") or context.config.get_main_option("sqlalchemy.url")
if context.is_offline_mode():
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_online(url))
