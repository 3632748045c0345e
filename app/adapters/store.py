"""The adapter store: PEFT folders in the data folder by content digest, and their table rows.

The folders are a local cache: the files themselves are recorded in PostgreSQL (app/adapters/file_rows.py)
with the row, and app/adapters/local_cache.py refills a folder that is missing or damaged.
"""

from __future__ import annotations

import logging
import re
import shutil
import uuid
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession

from app.adapters.file_rows import save_files
from app.db.tables import Adapter
from app.engine_clients.interface import AdapterInfo, EngineClient

logger = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
UPLOADS_FOLDER = ".uploads"
STORED_FOLDER_MODE = 0o755  # upload folders are created private (0700); stored ones read like copied ones
DIGEST = re.compile(r"[0-9a-f]{64}")


def store_root(home: Path) -> Path:
    return home / "adapters"


def stored_folder(home: Path, digest: str) -> Path:
    """Where the adapter with ``digest`` lives; the same bytes uploaded twice share one folder."""
    return store_root(home) / digest


def uploads_root(home: Path) -> Path:
    """Where uploads are received, one private random folder each; nothing there is ever served."""
    return store_root(home) / UPLOADS_FOLDER


def move_into_store(folder: Path, home: Path, digest: str) -> tuple[Path, bool]:
    """Move a received folder (holding only the two files) into the store under ``digest``.

    Returns the stored folder and whether this call created it; when the digest is stored already, the
    folder stays where it is (its owner removes it) and the stored copy, with the same bytes, is used.
    """
    target = stored_folder(home, digest)
    if target.is_dir():
        return target, False
    try:
        folder.rename(target)  # one filesystem: atomic, so a half-moved folder is never seen
    except OSError:
        if target.is_dir():  # another upload of the same bytes got there first
            return target, False
        raise
    target.chmod(STORED_FOLDER_MODE)
    return target, True


def remove_stored(home: Path, digest: str) -> None:
    """Delete the stored folder of ``digest`` (the caller checked that nothing uses it any more)."""
    if not DIGEST.fullmatch(digest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    shutil.rmtree(stored_folder(home, digest), ignore_errors=True)
    logger.info("removed stored adapter %s", digest[:12])


def copy_into_store(source: Path, home: Path, digest: str) -> Path:
    """Copy a PEFT folder's two files into the store (atomically: a half-copied folder is never seen)."""
    target = stored_folder(home, digest)
    if target.is_dir():
        return target
    staging = store_root(home) / f".staging-{uuid.uuid4().hex}"
    staging.mkdir(parents=True)
    try:
        for name in ADAPTER_FILES:
            shutil.copyfile(source / name, staging / name)
        staging.rename(target)
    except FileExistsError:
        shutil.rmtree(staging, ignore_errors=True)  # another writer stored the same digest first
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def adapter_row(tenant_id: uuid.UUID, name: str, base_model: str, info: AdapterInfo, folder: Path) -> Adapter:
    """The row of a validated adapter stored in ``folder``, ready to serve."""
    return Adapter(
        tenant_id=tenant_id,
        name=name,
        base_model=base_model,
        rank=info.rank,
        alpha=info.alpha,
        target_modules=list(info.target_modules),
        digest=info.digest,
        size_bytes=info.size_bytes,
        storage_path=str(folder),
        status="ready",
    )


async def register_adapter(
    session: AsyncSession, engine: EngineClient, home: Path, *, tenant_id: uuid.UUID, name: str, source: Path
) -> Adapter:
    """Validate ``source`` with the engine, store its files by digest (table and cache), and add the tenant's row."""
    info = await engine.validate_adapter(source)
    folder = copy_into_store(source, home, info.digest)
    await save_files(session, folder, info.digest)
    adapter = adapter_row(tenant_id, name, engine.model_name, info, folder)
    session.add(adapter)
    await session.flush()
    logger.info("adapter %s of tenant %s stored as %s (rank %d)", name, tenant_id, info.digest[:12], info.rank)
    return adapter
