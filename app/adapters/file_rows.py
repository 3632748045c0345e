"""Adapter files in PostgreSQL, one ``adapter_files`` row per content digest: the source of truth.

An upload writes the files row in the transaction that adds its adapter row (a ``pg_dump`` then holds
every adapter); the row goes when no live adapter row has its digest any more. Recording and dropping
both take a transaction-scoped advisory lock on the digest, so an upload of the same bytes on another
replica can never find the row, skip its insert, and then see it dropped under it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.tables import Adapter, AdapterFile
from engine.adapters.lora_adapter import CONFIG_FILE, WEIGHTS_FILE

DELETED = "deleted"
DIGEST_LOCK = text("SELECT pg_advisory_xact_lock(hashtext('adapter_files:' || :digest))")


def read_folder(folder: Path) -> tuple[bytes, bytes]:
    """The two files of a PEFT folder (blocking: run it off the event loop)."""
    return (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()


async def save_files(session: AsyncSession, folder: Path, digest: str) -> None:
    """Record the files of ``folder`` under ``digest`` in the caller's transaction (a no-op when recorded).

    The same digest means the same bytes, so a second upload of an adapter adds nothing.
    """
    await session.execute(DIGEST_LOCK, {"digest": digest})
    if await session.scalar(select(func.count()).select_from(AdapterFile).where(AdapterFile.digest == digest)):
        return
    config, weights = await asyncio.to_thread(read_folder, folder)
    row = {"digest": digest, "config": config, "weights": weights, "size_bytes": len(config) + len(weights)}
    await session.execute(insert(AdapterFile).values(row).on_conflict_do_nothing(index_elements=["digest"]))


async def drop_files_if_unused(session: AsyncSession, digest: str) -> bool:
    """Delete the files row of ``digest`` unless a live adapter row has it; True when none has it (row gone)."""
    await session.execute(DIGEST_LOCK, {"digest": digest})
    live = select(func.count()).select_from(Adapter).where(Adapter.digest == digest, Adapter.status != DELETED)
    if await session.scalar(live):
        return False
    await session.execute(AdapterFile.__table__.delete().where(AdapterFile.digest == digest))
    return True
