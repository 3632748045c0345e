"""An engine worker's adapters, fetched by content digest and cached locally.

A worker is told only a digest (Ray Serve's multiplexed model id), never a path. It reads the two files
from one of two sources: the ``adapter_files`` row of that digest in PostgreSQL, when the fetcher is
given a database URL (no file system shared with the gateways needed), else the stored folder
``<store>/<digest>`` of the gateway's adapter store (a path shared with the workers). It checks that the
bytes hash to the digest and keeps a copy in its own cache folder, where later loads read it. A digest
that is not 64 hex characters, files that are missing and bytes that do not match are refused with the
engine's adapter errors, so the gateway maps them as usual.

``fetch`` blocks (workers call it on a thread); the PostgreSQL read runs on an event loop of that
thread's own with one short-lived asyncpg connection, since only asyncpg is installed and a fetch
happens once per adapter and worker.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import asyncpg

from app.adapters.local_cache import write_verified
from app.adapters.store import ADAPTER_FILES, DIGEST
from app.db.database import CONNECT_TIMEOUT_S, driver_url
from engine.errors import AdapterNotFoundError

logger = logging.getLogger(__name__)

CONFIG_FILE, WEIGHTS_FILE = ADAPTER_FILES


FILES_QUERY = "SELECT config, weights FROM adapter_files WHERE digest = $1"


class AdapterFetcher:
    """Copies adapters from PostgreSQL (or the shared store) into a worker's cache folder, verified by digest."""

    def __init__(self, store_root: Path, cache_root: Path, database_url: str | None = None) -> None:
        self.store_root = store_root
        self.cache_root = cache_root
        self.database_url = database_url
        """Where ``adapter_files`` is; None: read the store folder instead."""

    def fetch(self, digest: str) -> Path:
        """The cached folder of the adapter with ``digest``, copied from the store and verified on first use."""
        if not DIGEST.fullmatch(digest):
            raise AdapterNotFoundError(f"not an adapter digest: {digest[:80]!r}")
        cached = self.cache_root / digest
        if cached.is_dir():
            return cached
        config_bytes, weights_bytes = self._read(digest)
        write_verified(cached, digest, config_bytes, weights_bytes)
        logger.info("adapter %s fetched into %s", digest[:12], self.cache_root)
        return cached

    def _read(self, digest: str) -> tuple[bytes, bytes]:
        """The files from PostgreSQL when a URL is given, else (or when the database lacks them) the store."""
        if self.database_url is not None:
            try:
                return asyncio.run(_read_database(self.database_url, digest))
            except AdapterNotFoundError:
                logger.info("adapter %s is not in adapter_files; reading the store folder", digest[:12])
        return self._read_store(digest)

    def _read_store(self, digest: str) -> tuple[bytes, bytes]:
        source = self.store_root / digest
        try:
            return (source / CONFIG_FILE).read_bytes(), (source / WEIGHTS_FILE).read_bytes()
        except FileNotFoundError:
            raise AdapterNotFoundError(f"adapter {digest[:12]} is not in the store at {self.store_root}") from None


async def _read_database(url: str, digest: str) -> tuple[bytes, bytes]:
    """The two files of ``digest`` from ``adapter_files``, over one short-lived connection."""
    connection = await asyncpg.connect(driver_url(url), timeout=CONNECT_TIMEOUT_S)
    try:
        row = await connection.fetchrow(FILES_QUERY, digest)
    finally:
        await connection.close()
    if row is None:
        raise AdapterNotFoundError(f"adapter {digest[:12]} is not in the database's adapter_files")
    return bytes(row["config"]), bytes(row["weights"])
