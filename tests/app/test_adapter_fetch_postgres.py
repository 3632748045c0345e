"""An engine worker given a database URL fetches adapters from ``adapter_files`` by digest, verified and cached."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest

from app.cluster.adapter_fetch import AdapterFetcher
from engine.adapters.lora_adapter import adapter_digest
from engine.errors import AdapterMismatchError, AdapterNotFoundError

CONFIG, WEIGHTS = b'{"r": 4}', b"\x00weights\xff" * 100


def _execute(url: str, query: str, *args: object) -> None:
    async def run() -> None:
        connection = await asyncpg.connect(url)
        try:
            await connection.execute(query, *args)
        finally:
            await connection.close()

    asyncio.run(run())


def _store_row(url: str, digest: str, config: bytes, weights: bytes) -> None:
    _execute(
        url,
        "INSERT INTO adapter_files (digest, config, weights, size_bytes) VALUES ($1, $2, $3, $4)",
        digest,
        config,
        weights,
        len(config) + len(weights),
    )


def test_an_adapter_in_postgres_is_fetched_verified_and_cached(database_url: str, tmp_path: Path) -> None:
    digest = adapter_digest(CONFIG, WEIGHTS)
    _store_row(database_url, digest, CONFIG, WEIGHTS)
    fetcher = AdapterFetcher(tmp_path / "no-shared-store", tmp_path / "cache", database_url)
    cached = fetcher.fetch(digest)
    assert cached == tmp_path / "cache" / digest
    assert (cached / "adapter_config.json").read_bytes() == CONFIG
    assert (cached / "adapter_model.safetensors").read_bytes() == WEIGHTS
    _execute(database_url, "DELETE FROM adapter_files WHERE digest = $1", digest)
    assert fetcher.fetch(digest) == cached, "later loads read the worker's own copy"


def test_a_row_whose_bytes_do_not_match_is_refused_and_a_missing_one_is_not_found(
    database_url: str, tmp_path: Path
) -> None:
    digest = adapter_digest(CONFIG, WEIGHTS)
    _store_row(database_url, digest, CONFIG, b"tampered")
    fetcher = AdapterFetcher(tmp_path / "store", tmp_path / "cache", database_url)
    with pytest.raises(AdapterMismatchError, match="other bytes"):
        fetcher.fetch(digest)
    assert not (tmp_path / "cache" / digest).exists()
    with pytest.raises(AdapterNotFoundError, match="not in the store"):  # in neither source
        fetcher.fetch("ab" * 32)


def test_an_adapter_missing_from_postgres_is_read_from_the_store_folder(database_url: str, tmp_path: Path) -> None:
    digest = adapter_digest(CONFIG, WEIGHTS)
    stored = tmp_path / "store" / digest
    stored.mkdir(parents=True)
    (stored / "adapter_config.json").write_bytes(CONFIG)
    (stored / "adapter_model.safetensors").write_bytes(WEIGHTS)
    fetcher = AdapterFetcher(tmp_path / "store", tmp_path / "cache", database_url)
    assert (fetcher.fetch(digest) / "adapter_model.safetensors").read_bytes() == WEIGHTS
