"""The page pool's lists, references and prefix-cache map, without a model."""

import pytest
import torch

from engine.errors import PoolExhaustedError
from engine.memory.page_pool import OwnerKind, PagePool


def _pool(num_pages: int = 6) -> PagePool:
    return PagePool(
        num_pages,
        num_layers=2,
        block_size=4,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_layout_matches_the_design() -> None:
    pool = _pool()
    assert pool.storage.shape == (6, 2, 4 * 2 * 1 * 8)  # [num_pages, num_layers, P]
    layer = pool.kv_layer(1)
    assert layer.shape == (6, 2, 4, 1, 8)
    layer[3, 1, 2, 0, 5] = 7.0
    assert pool.storage[3, 1, 1 * 32 + 2 * 8 + 5] == 7.0


def test_allocation_prefers_free_pages_then_the_oldest_cached_block() -> None:
    pool = _pool(4)
    a = pool.allocate(2)
    pool.register_block(a[0], b"h0")
    pool.register_block(a[1], b"h1")
    pool.free(a)  # tail first: h1's page becomes the oldest cached block
    assert pool.stats().pages_by_owner == {"free": 2, "kv": 0, "prefix_cache": 2, "adapter": 0, "scratch": 0}
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(a), "free pages go before cached blocks"
    evicted = pool.allocate(1)
    assert evicted == [a[1]] and pool.lookup(b"h1") is None and pool.lookup(b"h0") == a[0]
    pool.check_invariants()
    with pytest.raises(PoolExhaustedError):
        pool.allocate(2)


def test_a_prefix_hit_takes_a_cached_block_out_of_the_middle_of_its_list() -> None:
    pool = _pool(4)
    pages = pool.allocate(3)
    for i, page in enumerate(pages):
        pool.register_block(page, bytes([i]))
    pool.free(pages)
    hit = pool.lookup(bytes([1]))
    pool.acquire(hit)
    pool.acquire(hit)
    assert pool.pages[hit].owner is OwnerKind.KV and pool.pages[hit].ref_count == 2
    pool.check_invariants()
    pool.free([hit])
    pool.free([hit])
    assert pool.pages[hit].owner is OwnerKind.PREFIX_CACHE
    with pytest.raises(AssertionError):
        pool.free([hit])
    pool.check_invariants()


def test_first_page_to_register_a_hash_keeps_it() -> None:
    pool = _pool(3)
    first, second = pool.allocate(2)
    pool.register_block(first, b"same")
    pool.register_block(second, b"same")
    assert pool.lookup(b"same") == first and pool.pages[second].block_hash is None
    pool.free([first, second])
    assert pool.pages[second].owner is OwnerKind.FREE
    pool.check_invariants()
