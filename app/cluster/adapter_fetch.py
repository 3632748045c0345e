"""An engine worker's adapters, fetched by content digest from the gateway's store and cached locally.

A worker is told only a digest (Ray Serve's multiplexed model id), never a path: it reads the stored
folder ``<store>/<digest>`` (the gateway's adapter store, a path shared with the workers until the files
move into PostgreSQL), checks that the bytes hash to that digest, and keeps a copy in its own cache
folder, where later loads read it. A digest that is not 64 hex characters, a folder that is missing and
bytes that do not match are refused with the engine's adapter errors, so the gateway maps them as usual.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path

from app.adapters.store import ADAPTER_FILES, DIGEST
from engine.errors import AdapterMismatchError, AdapterNotFoundError
from engine.lora_adapter import adapter_digest

logger = logging.getLogger(__name__)

CONFIG_FILE, WEIGHTS_FILE = ADAPTER_FILES


class AdapterFetcher:
    """Copies adapters from the shared store into a worker's cache folder, verified by digest."""

    def __init__(self, store_root: Path, cache_root: Path) -> None:
        self.store_root = store_root
        self.cache_root = cache_root

    def fetch(self, digest: str) -> Path:
        """The cached folder of the adapter with ``digest``, copied from the store and verified on first use."""
        if not DIGEST.fullmatch(digest):
            raise AdapterNotFoundError(f"not an adapter digest: {digest[:80]!r}")
        cached = self.cache_root / digest
        if cached.is_dir():
            return cached
        source = self.store_root / digest
        try:
            config_bytes = (source / CONFIG_FILE).read_bytes()
            weights_bytes = (source / WEIGHTS_FILE).read_bytes()
        except FileNotFoundError:
            raise AdapterNotFoundError(f"adapter {digest[:12]} is not in the store at {self.store_root}") from None
        found = adapter_digest(config_bytes, weights_bytes)
        if found != digest:
            raise AdapterMismatchError(f"the stored adapter {digest[:12]} holds other bytes (digest {found[:12]})")
        self._write(cached, config_bytes, weights_bytes)
        logger.info("adapter %s fetched from the store into %s", digest[:12], self.cache_root)
        return cached

    def _write(self, target: Path, config_bytes: bytes, weights_bytes: bytes) -> None:
        """Write the two files into ``target`` atomically: a half-written folder is never seen."""
        self.cache_root.mkdir(parents=True, exist_ok=True)
        staging = self.cache_root / f".staging-{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            (staging / CONFIG_FILE).write_bytes(config_bytes)
            (staging / WEIGHTS_FILE).write_bytes(weights_bytes)
            staging.rename(target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not target.is_dir():  # else another fetch of the same digest got there first
                raise
