"""The local folders that cache adapter files: ``$LORAPLEX_HOME/adapters/<digest>``, filled from PostgreSQL.

The ``adapter_files`` table is the source of truth (app/adapters/file_rows.py); the folder is what the
engine reads. Before the engine registers an adapter, :func:`ensure_local` checks the folder's bytes
against the digest and fills it from the table when it is missing or damaged, so any replica (with its
own data folder) serves any adapter, and a lost or corrupted cache heals itself.

The check reads and hashes the whole folder (sha256: little for a small model's adapter, most of a
second at the upload cap; docs/benchmarks.md#gateway-constants-and-choices). It
runs once per registration, not per request: the engine keeps the weights it read, so a folder damaged
afterwards is noticed at the next registration.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from pathlib import Path

from sqlalchemy import select

from app.adapters.file_rows import read_folder
from app.adapters.store import ADAPTER_FILES, DIGEST, stored_folder
from app.db.database import Database
from app.db.tables import AdapterFile
from engine.adapters.lora_adapter import adapter_digest
from engine.errors import AdapterMismatchError, AdapterNotFoundError

logger = logging.getLogger(__name__)

CONFIG_FILE, WEIGHTS_FILE = ADAPTER_FILES


async def ensure_local(database: Database, home: Path, digest: str) -> Path:
    """The local folder of ``digest``, checked against the digest and (re)filled from the table if needed.

    Reads (megabytes) and the hashing happen off the event loop. Raises the engine's adapter errors:
    ``AdapterNotFoundError`` when the table has no such row, ``AdapterMismatchError`` when its bytes do
    not hash to the digest (a damaged database; nothing is cached then).
    """
    if not DIGEST.fullmatch(digest):
        raise AdapterNotFoundError(f"not an adapter digest: {digest[:80]!r}")
    folder = stored_folder(home, digest)
    if await asyncio.to_thread(_cached_matches, folder, digest):
        return folder
    async with database.sessions() as session:
        files = (
            await session.execute(select(AdapterFile.config, AdapterFile.weights).where(AdapterFile.digest == digest))
        ).first()
    if files is None:
        raise AdapterNotFoundError(f"adapter {digest[:12]} is not in the database's adapter_files; upload it again")
    await asyncio.to_thread(write_verified, folder, digest, files.config, files.weights)
    logger.info("adapter %s cached from the database into %s", digest[:12], folder)
    return folder


def _cached_matches(folder: Path, digest: str) -> bool:
    """True when ``folder`` holds the two files and they hash to ``digest``; a damaged folder is removed."""
    if not folder.is_dir():
        return False
    try:
        found = adapter_digest(*read_folder(folder))
    except OSError:
        found = None
    if found == digest:
        return True
    logger.warning("cached adapter %s at %s holds other bytes (%s); refilling it", digest[:12], folder, found)
    shutil.rmtree(folder, ignore_errors=True)
    return False


def write_verified(folder: Path, digest: str, config: bytes, weights: bytes) -> None:
    """Verify the bytes against ``digest``, then write them into ``folder`` atomically (a half-written folder
    is never seen; when another writer of the same digest got there first, its folder stands)."""
    found = adapter_digest(config, weights)
    if found != digest:
        raise AdapterMismatchError(f"the adapter {digest[:12]} as read holds other bytes (digest {found[:12]})")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".staging-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        (staging / CONFIG_FILE).write_bytes(config)
        (staging / WEIGHTS_FILE).write_bytes(weights)
        staging.rename(folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not folder.is_dir():  # else another fill of the same digest got there first
            raise
