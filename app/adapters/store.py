"""The adapter store: PEFT folders kept in the data folder by content digest, and their table rows."""

from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession

from app.db.tables import Adapter
from app.engine_client import EngineClient

logger = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def store_root(home: Path) -> Path:
    return home / "adapters"


def stored_folder(home: Path, digest: str) -> Path:
    """Where the adapter with ``digest`` lives; the same bytes uploaded twice share one folder."""
    return store_root(home) / digest


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


async def register_adapter(
    session: AsyncSession, engine: EngineClient, home: Path, *, tenant_id: uuid.UUID, name: str, source: Path
) -> Adapter:
    """Validate ``source`` with the engine, store its files by digest, and add the tenant's row."""
    info = await engine.validate_adapter(source)
    folder = copy_into_store(source, home, info.digest)
    adapter = Adapter(
        tenant_id=tenant_id,
        name=name,
        base_model=engine.model_name,
        rank=info.rank,
        alpha=info.alpha,
        target_modules=list(info.target_modules),
        digest=info.digest,
        size_bytes=info.size_bytes,
        storage_path=str(folder),
        status="ready",
    )
    session.add(adapter)
    await session.flush()
    logger.info("adapter %s of tenant %s stored as %s (rank %d)", name, tenant_id, info.digest[:12], info.rank)
    return adapter
