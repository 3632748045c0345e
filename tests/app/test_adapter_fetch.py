"""An engine worker fetches adapters from the store by digest only, verifies the bytes, and caches them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app.adapters.store import copy_into_store, store_root
from app.cluster.adapter_fetch import AdapterFetcher
from engine.adapters.lora_adapter import adapter_digest
from engine.errors import AdapterMismatchError, AdapterNotFoundError


def _adapter(folder: Path, weights: bytes = b"weights") -> tuple[Path, str]:
    folder.mkdir(parents=True)
    config = b'{"r": 4}'
    (folder / "adapter_config.json").write_bytes(config)
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder, adapter_digest(config, weights)


def test_a_stored_adapter_is_fetched_verified_and_cached(tmp_path: Path) -> None:
    source, digest = _adapter(tmp_path / "upload")
    copy_into_store(source, tmp_path / "home", digest)
    fetcher = AdapterFetcher(store_root(tmp_path / "home"), tmp_path / "cache")
    cached = fetcher.fetch(digest)
    assert cached == tmp_path / "cache" / digest
    assert (cached / "adapter_model.safetensors").read_bytes() == b"weights"
    shutil.rmtree(store_root(tmp_path / "home") / digest)
    assert fetcher.fetch(digest) == cached, "later loads read the worker's own copy"


def test_bytes_that_do_not_match_their_digest_are_refused(tmp_path: Path) -> None:
    source, digest = _adapter(tmp_path / "upload")
    stored = copy_into_store(source, tmp_path / "home", digest)
    (stored / "adapter_model.safetensors").write_bytes(b"tampered")
    fetcher = AdapterFetcher(store_root(tmp_path / "home"), tmp_path / "cache")
    with pytest.raises(AdapterMismatchError, match="other bytes"):
        fetcher.fetch(digest)
    assert not (tmp_path / "cache" / digest).exists()


@pytest.mark.parametrize("name", ["../../etc", "0" * 63, "A" * 64, "/abs/path"])
def test_only_a_digest_names_an_adapter_never_a_path(tmp_path: Path, name: str) -> None:
    fetcher = AdapterFetcher(tmp_path / "store", tmp_path / "cache")
    with pytest.raises(AdapterNotFoundError, match="not an adapter digest"):
        fetcher.fetch(name)


def test_a_digest_missing_from_the_store_is_not_found(tmp_path: Path) -> None:
    fetcher = AdapterFetcher(tmp_path / "store", tmp_path / "cache")
    with pytest.raises(AdapterNotFoundError, match="not in the store"):
        fetcher.fetch("ab" * 32)
