"""The unified page pool: one tensor of pages shared by KV blocks and adapter weights."""

import enum
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import DEFAULT_CPU_POOL_BYTES, DEFAULT_GPU_MEMORY_FRACTION, EngineConfig, ModelConfig
from engine.errors import ConfigError, PoolExhaustedError
from engine.memory.host_memory import zeros_on_huge_pages
from engine.memory.host_to_device import move_to_device

logger = logging.getLogger(__name__)


class OwnerKind(enum.Enum):
    FREE = "free"
    KV = "kv"  # a running sequence's KV block (possibly shared by several through the prefix cache)
    PREFIX_CACHE = "prefix_cache"  # a full KV block nobody uses now, kept for prefix hits
    ADAPTER = "adapter"  # rows of a resident adapter's weights
    SCRATCH = "scratch"  # written by the padding rows of CUDA graphs' steps, read by nobody (step/decode_graphs.py)


@dataclass(slots=True)
class Page:
    page_id: int
    owner: OwnerKind = OwnerKind.FREE
    ref_count: int = 0
    block_hash: bytes | None = None  # set while the page holds a full KV block registered for reuse


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_pages: int
    block_size: int
    page_bytes: int
    pages_by_owner: dict[str, int]


class Reclaimer(Protocol):
    """Owner of pages the pool may take back under pressure (the adapter cache's idle adapters)."""

    def reclaimable_pages(self) -> int: ...

    def reclaim(self, num_pages: int) -> int: ...


class PagePool:
    """Every page of the engine, with one free list.

    ``storage`` is ``[num_pages, num_layers, P]`` (docs/architecture.md) in the pool's one dtype, K/V and
    adapters alike; a KV block is one page, and ``storage[p, l]`` viewed as
    ``[2, block_size, num_kv_heads, head_dim]`` holds layer ``l``'s K and V, so a page is either kind's.

    Pressure order when a page is needed: free pages first, then cached prefix blocks with no user,
    least recently used first (their hash is dropped), then idle adapters through the ``reclaimer``
    (least recently used first); preempting a running sequence is the scheduler's move after that.
    Both lists are ordered dicts, so a cached block leaves the middle of its list in O(1) on a hit.
    """

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 1:
            raise PoolExhaustedError("the page pool has no pages; give the engine a larger pool_bytes")
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        page_elems = block_size * 2 * num_kv_heads * head_dim  # P
        shape = (num_pages, num_layers, page_elems)
        # huge_pages: whether the CPU pool was advised for huge pages in a mode that gives them (host_memory.py)
        if device.type == "cpu":  # [N, L, P]
            self.storage, self.huge_pages = zeros_on_huge_pages(shape, dtype)
        else:
            self.storage, self.huge_pages = torch.zeros(shape, dtype=dtype, device=device), False
        self.pages = [Page(page_id) for page_id in range(num_pages)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._cached: OrderedDict[int, None] = OrderedDict()  # evictable prefix blocks, oldest first
        self._hash_to_page: dict[bytes, int] = {}
        self.reclaimer: Reclaimer | None = None

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_allocatable(self) -> int:
        """Pages that can be handed out now: free ones, evictable cached prefix blocks, idle adapters'."""
        reclaimable = self.reclaimer.reclaimable_pages() if self.reclaimer is not None else 0
        return len(self._free) + len(self._cached) + reclaimable

    def kv_layer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s view of every page as a KV block: [num_pages, 2, block_size, kv_heads, head_dim]."""
        return self.storage[:, layer].view(self.num_pages, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_allocatable

    def allocate(self, num_pages: int, owner: OwnerKind = OwnerKind.KV) -> list[int]:
        """Take ``num_pages`` pages (free first, then the oldest cached blocks), each with one reference."""
        if not self.can_allocate(num_pages):
            raise PoolExhaustedError(f"asked for {num_pages} pages but only {self.num_allocatable} can be freed")
        shortfall = num_pages - len(self._free) - len(self._cached)
        if shortfall > 0 and self.reclaimer is not None:
            self.reclaimer.reclaim(shortfall)
        page_ids = []
        for _ in range(num_pages):
            if self._free:
                page_id, _ = self._free.popitem(last=False)
            else:
                page_id, _ = self._cached.popitem(last=False)
                page = self.pages[page_id]
                del self._hash_to_page[page.block_hash]
                page.block_hash = None
            page = self.pages[page_id]
            page.owner = owner
            page.ref_count = 1
            page_ids.append(page_id)
        return page_ids

    def free(self, page_ids: list[int]) -> None:
        """Drop one reference from each page; a page nobody holds goes back to a list.

        Pages are released last to first, so a sequence's tail blocks are evicted before its head
        blocks, which other prompts are likelier to share.
        """
        for page_id in reversed(page_ids):
            page = self.pages[page_id]
            if page.ref_count <= 0:
                raise AssertionError(f"page {page_id} freed with ref_count {page.ref_count}")
            page.ref_count -= 1
            if page.ref_count:
                continue
            if page.block_hash is not None:
                page.owner = OwnerKind.PREFIX_CACHE
                self._cached[page_id] = None
            else:
                page.owner = OwnerKind.FREE
                self._free[page_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        """The page holding the KV block with this chain hash, if it is still cached."""
        return self._hash_to_page.get(block_hash)

    def acquire(self, page_id: int) -> None:
        """Take one more reference to a cached KV block (a prefix hit)."""
        page = self.pages[page_id]
        if page.ref_count == 0:
            del self._cached[page_id]
            page.owner = OwnerKind.KV
        page.ref_count += 1

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) page's contents in every layer; a destination named twice takes the last."""
        if not copies:
            return
        last = {dst: src for src, dst in copies}  # a page freed and handed out again in one step is named twice
        pairs = torch.tensor([list(last.values()), list(last)])  # [2, num_copies]: sources, destinations
        sources, destinations = move_to_device(pairs, self.storage.device)  # [num_copies] each
        self.storage.index_copy_(0, destinations, self.storage.index_select(0, sources))  # [num_copies, L, P] moved

    def register_block(self, page_id: int, block_hash: bytes) -> None:
        """Record that ``page_id`` holds the full KV block ``block_hash``; the first page to do so wins."""
        page = self.pages[page_id]
        if page.block_hash is not None or block_hash in self._hash_to_page:
            return
        page.block_hash = block_hash
        self._hash_to_page[block_hash] = page_id

    def stats(self) -> PoolStats:
        counts = {kind.value: 0 for kind in OwnerKind}
        for page in self.pages:
            counts[page.owner.value] += 1
        page_bytes = self.storage[0].numel() * self.storage.element_size()
        return PoolStats(self.num_pages, self.block_size, page_bytes, counts)

    def check_invariants(self) -> None:
        """Raise AssertionError if the lists, owners, references and hash map disagree."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and len(cached) == len(self._cached)
        assert not free & cached, "a page is both free and cached"
        for page in self.pages:
            assert page.ref_count >= 0, f"page {page.page_id} has ref_count {page.ref_count}"
            in_free, in_cached = page.page_id in free, page.page_id in cached
            if page.owner is OwnerKind.FREE:
                assert in_free and page.ref_count == 0 and page.block_hash is None, page
            elif page.owner is OwnerKind.PREFIX_CACHE:
                assert in_cached and page.ref_count == 0 and page.block_hash is not None, page
            else:
                assert not in_free and not in_cached and page.ref_count > 0, page
            if page.block_hash is not None:
                assert self._hash_to_page.get(page.block_hash) == page.page_id, page
        assert len(self._hash_to_page) == sum(p.block_hash is not None for p in self.pages)


@dataclass(frozen=True, slots=True)
class PoolSize:
    """How large an engine's pool is, and from which budget."""

    num_pages: int
    block_size: int
    page_bytes: int  # one page across every layer
    budget_bytes: int


def page_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page across all layers: a KV block of ``block_size`` tokens in ``dtype``."""
    return cfg.num_layers * cfg.page_elems(block_size) * torch.finfo(dtype).bits // 8


def size_pool(
    config: EngineConfig,
    cfg: ModelConfig,
    dtype: torch.dtype,
    free_device_bytes: int | None,
) -> PoolSize:
    """The pool's pages from ``config.pool_bytes``, else a share of ``free_device_bytes``, else the CPU default.

    ``free_device_bytes`` is the device's free memory once the weights are loaded (CUDA's
    ``mem_get_info``), None on CPU. An explicit ``pool_bytes`` must hold one page: requests longer than the
    pool are refused one by one. A budget the engine picks itself from free GPU memory must hold one
    sequence of the model's whole context, else most long requests would be refused for a reason the user
    never chose; either shortfall is a ConfigError saying what to change.
    """
    block_size = config.block_size or cfg.pick_block_size()
    if cfg.page_elems(block_size) < cfg.widest_row:
        logger.warning("block_size %d leaves pages narrower than the widest adapter row", block_size)
    one_page = page_bytes(cfg, block_size, dtype)
    min_pages = 1
    if config.pool_bytes is not None:
        budget = config.pool_bytes
        source = f"pool_bytes={budget}"
        advice = f"give pool_bytes at least {one_page} (one page)"
    elif free_device_bytes is not None:
        budget = int(free_device_bytes * DEFAULT_GPU_MEMORY_FRACTION)
        min_pages = -(-cfg.max_model_len // block_size)
        source = (
            f"{DEFAULT_GPU_MEMORY_FRACTION:.0%} of the {free_device_bytes / 2**30:.2f} GiB of free GPU memory, "
            f"{min_pages} pages being one sequence of the model's {cfg.max_model_len} tokens"
        )
        advice = f"free GPU memory held by other processes, or set pool_bytes (at least {min_pages * one_page})"
    else:
        budget = DEFAULT_CPU_POOL_BYTES
        source = f"the CPU default of {budget} bytes"
        advice = f"set pool_bytes to at least {one_page} (one page)"
    num_pages = budget // one_page
    if num_pages < min_pages:
        raise ConfigError(
            f"the page pool would get {num_pages} pages of {block_size} tokens ({one_page} bytes each) from "
            f"{source}; it needs at least {min_pages}: {advice}"
        )
    return PoolSize(num_pages, block_size, one_page, budget)


def make_pool(
    config: EngineConfig,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> PagePool:
    """The pool an engine of ``config`` gets (see :func:`size_pool`), K/V and adapters in ``dtype``; reads
    CUDA's free memory when it sizes by it."""
    free_device_bytes = None
    if device.type == "cuda" and config.pool_bytes is None:
        free_device_bytes, _ = torch.cuda.mem_get_info(device)
    size = size_pool(config, cfg, dtype, free_device_bytes)
    return PagePool(
        size.num_pages,
        cfg.num_layers,
        size.block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype,
        device,
    )
