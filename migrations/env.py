"""Alembic's entry point: runs the revisions over one asyncpg connection."""

import asyncio

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from app.db.database import async_url
from app.db.tables import Base

target_metadata = Base.metadata


def _record_applied(*, step, **_) -> None:
    """List each revision applied where app.db.migrate.upgrade reads them (when it is the caller)."""
    applied = context.config.attributes.get("applied_revisions")
    if applied is not None:
        applied.extend(step.up_revision_ids)


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, on_version_apply=_record_applied)
    with context.begin_transaction():
        context.run_migrations()


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
