"""Adapters in three tiers: the PEFT folder on disk, a bounded host-memory cache, and the page pool.

An adapter is *registered* once validated (``add``). It becomes *resident* when a sequence that needs
it is admitted: its rows are copied into pages of the unified pool (``acquire``), and sequences hold a
reference while they run. A resident adapter nobody runs and nobody pinned is *idle*: its pages are
reclaimable, least recently used first, after free pages and cached prefix blocks (the pool asks
through :meth:`reclaim`). The host copy of an adapter is the contents of its pages in the pool's dtype
(pinned on CUDA), so loading it is a copy of pages (:mod:`engine.adapters.adapter_upload`: on a side stream on
CUDA, fenced by an event the compute stream waits on in :meth:`acquire`). Host copies beyond
``max_host_bytes`` are dropped least recently used first and read again from disk when needed; the
digest must not have changed.

Removing or replacing an adapter that unfinished requests name is refused (``AdapterBusyError``): the
caller waits for them or aborts them; the engine never pulls weights from under a running sequence.
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.adapters.adapter_layout import AdapterLayout, pack_pages, pages_for_rank, plan_layout
from engine.adapters.adapter_upload import AdapterUpload, Event, make_upload
from engine.adapters.lora_adapter import LoraAdapter, load_lora_adapter
from engine.config import ModelConfig
from engine.errors import AdapterBusyError, AdapterMismatchError, UnknownAdapterError
from engine.memory.page_pool import OwnerKind, PagePool

logger = logging.getLogger(__name__)

# How adapter capacity is counted (it sizes Ray Serve's multiplexing cache and vLLM's ``max_lora`` gauge):
# adapters of this rank on every projection, in this share of the pool (the rest keeps a batch's KV).
REFERENCE_RANK = 16
ADAPTER_POOL_SHARE = 0.5


@dataclass(slots=True, eq=False)
class AdapterEntry:
    name: str
    path: Path
    digest: str
    modules: tuple[str, ...]
    ranks: dict[str, int]
    layout: AdapterLayout
    host_bytes: int
    host: torch.Tensor | None  # [num_pages, num_layers, P] in the pool's dtype: its pages' contents, on the host
    page_ids: list[int] = field(default_factory=list)
    row_addr: torch.Tensor | None = None  # [num_rows] int64 on the host, while resident
    row_addr_list: list[int] = field(default_factory=list)  # the same, as a list
    copying: Event | None = None  # the load's copy into the pool, until the compute stream is ordered after it
    num_running: int = 0  # sequences running with it (they hold its pages)
    num_requests: int = 0  # unfinished requests that name it
    pinned: bool = False

    @property
    def is_resident(self) -> bool:
        return bool(self.page_ids)

    @property
    def digest_bytes(self) -> bytes:
        return bytes.fromhex(self.digest)


class AdapterCache:
    """Registered adapters, their host copies and their residency in the pool."""

    def __init__(
        self, pool: PagePool, model: ModelConfig, max_host_bytes: int, upload: AdapterUpload | None = None
    ) -> None:
        self.pool = pool
        self.model = model
        self.max_host_bytes = max_host_bytes
        self.upload = upload or make_upload(pool.storage.device)
        self._entries: dict[str, AdapterEntry] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()  # resident, unused, unpinned; oldest first
        self._host_lru: OrderedDict[str, None] = OrderedDict()
        self._num_idle_pages = 0
        self._num_loads = 0
        pool.reclaimer = self

    # Registry ------------------------------------------------------------------------------------

    def add(self, name: str, path: Path, adapter: LoraAdapter | None = None) -> AdapterEntry:
        """Validate the PEFT folder and register it under ``name`` (host tier); replaces an unused one.

        ``adapter``, when given, is the folder already validated by :func:`load_lora_adapter` (off the
        step thread, so that reading files never stalls a step).
        """
        adapter = adapter or load_lora_adapter(Path(path), self.model)
        old = self._entries.get(name)
        if old is not None:
            if old.num_requests:
                raise AdapterBusyError(
                    f"adapter {name!r} is used by {old.num_requests} unfinished request(s); wait for them "
                    "or abort them before replacing it"
                )
            self._drop(old)
        layout = plan_layout(adapter, self.model, self.pool.storage.shape[2])
        host = self._pack(adapter, layout)
        entry = AdapterEntry(
            name=name,
            path=Path(path),
            digest=adapter.digest,
            modules=adapter.modules,
            ranks=adapter.ranks,
            layout=layout,
            host_bytes=host.numel() * host.element_size(),
            host=host,
        )
        self._entries[name] = entry
        self._touch_host(entry)
        logger.info(
            "adapter %s registered: modules %s, ranks %s, %d pages",
            name,
            ",".join(entry.modules),
            entry.ranks,
            layout.num_pages,
        )
        return entry

    def remove(self, name: str) -> None:
        """Forget ``name`` and free its pages; refused while unfinished requests name it."""
        entry = self.get(name)
        if entry.num_requests:
            raise AdapterBusyError(
                f"adapter {name!r} is used by {entry.num_requests} unfinished request(s); wait for them or "
                "abort them before removing it"
            )
        self._drop(entry)

    def get(self, name: str) -> AdapterEntry:
        entry = self._entries.get(name)
        if entry is None:
            raise UnknownAdapterError(f"unknown adapter {name!r}: add it to the engine first")
        return entry

    def names(self) -> list[str]:
        return list(self._entries)

    def pin(self, name: str, pinned: bool = True) -> None:
        """Keep an adapter resident (loaded now if the pool has room) or let it be evicted again."""
        entry = self.get(name)
        entry.pinned = pinned
        if pinned and not entry.is_resident:
            self._load(entry)
        self._update_idle(entry)

    # Residency -------------------------------------------------------------------------------------

    def acquire(self, entry: AdapterEntry) -> bool:
        """Make ``entry`` resident (loading it if needed) and count one more running sequence.

        False when its pages cannot be found now; the caller tries again later. The sequence runs in the
        step being scheduled, so the compute stream is ordered after the adapter's copy here.
        """
        if not entry.is_resident and not self._load(entry):
            return False
        self._order_after_copy(entry)
        entry.num_running += 1
        self._update_idle(entry)
        return True

    def release(self, entry: AdapterEntry) -> None:
        entry.num_running -= 1
        assert entry.num_running >= 0, f"adapter {entry.name} released more often than acquired"
        self._update_idle(entry)

    def reclaimable_pages(self) -> int:
        return self._num_idle_pages

    def reclaim(self, num_pages: int) -> int:
        """Evict idle adapters, least recently used first, until ``num_pages`` pages are freed."""
        freed = 0
        while freed < num_pages and self._idle:
            name, _ = self._idle.popitem(last=False)
            entry = self._entries[name]
            self._num_idle_pages -= len(entry.page_ids)
            freed += len(entry.page_ids)
            self._evict(entry)
        return freed

    def capacity(self, rank: int = REFERENCE_RANK) -> int:
        """How many rank-``rank`` all-projection adapters can be registered and resident at once (at least 1).

        The smaller of what ``ADAPTER_POOL_SHARE`` of the pool's pages and the host cache hold; a count of
        adapters for callers that think in adapters, while residency itself stays page-based.
        """
        _, num_layers, page_elems = self.pool.storage.shape
        pages = pages_for_rank(self.model, rank, page_elems)
        host_bytes = pages * num_layers * page_elems * self.pool.storage.element_size()
        by_pool = int(self.pool.num_pages * ADAPTER_POOL_SHARE) // pages
        return max(1, min(by_pool, self.max_host_bytes // host_bytes))

    @property
    def num_resident(self) -> int:
        return sum(entry.is_resident for entry in self._entries.values())

    @property
    def num_loads(self) -> int:
        return self._num_loads

    def _load(self, entry: AdapterEntry) -> bool:
        num_pages = entry.layout.num_pages
        if not self.pool.can_allocate(num_pages):
            return False
        host = self._host_copy(entry)
        page_ids = self.pool.allocate(num_pages, OwnerKind.ADAPTER)
        entry.copying = self.upload.copy(self.pool.storage, page_ids, host)
        entry.page_ids = page_ids
        entry.row_addr = entry.layout.row_addr(
            page_ids, self.pool.storage.shape[1], self.pool.storage.shape[2]
        )  # [num_rows], on the host: the step's SGMV tables are built there
        entry.row_addr_list = entry.row_addr.tolist()
        self._num_loads += 1
        return True

    def _order_after_copy(self, entry: AdapterEntry) -> None:
        """Make the compute stream wait for the entry's pending copy, if any (never the host)."""
        if entry.copying is not None:
            self.upload.wait(entry.copying)
            entry.copying = None

    def _evict(self, entry: AdapterEntry) -> None:
        self._order_after_copy(entry)  # the pages' next owner writes them on the compute stream
        self.pool.free(entry.page_ids)
        entry.page_ids = []
        entry.row_addr = None
        entry.row_addr_list = []

    def _drop(self, entry: AdapterEntry) -> None:
        if entry.name in self._idle:
            del self._idle[entry.name]
            self._num_idle_pages -= len(entry.page_ids)
        if entry.is_resident:
            self._evict(entry)
        self._host_lru.pop(entry.name, None)
        del self._entries[entry.name]

    def _update_idle(self, entry: AdapterEntry) -> None:
        idle = entry.is_resident and entry.num_running == 0 and not entry.pinned
        if idle and entry.name not in self._idle:
            self._idle[entry.name] = None
            self._num_idle_pages += len(entry.page_ids)
        elif not idle and entry.name in self._idle:
            del self._idle[entry.name]
            self._num_idle_pages -= len(entry.page_ids)
        elif idle:
            self._idle.move_to_end(entry.name)

    def _host_copy(self, entry: AdapterEntry) -> LoraAdapter:
        if entry.host is None:
            adapter = load_lora_adapter(entry.path, self.model)
            if adapter.digest != entry.digest:
                raise AdapterMismatchError(
                    f"adapter {entry.name!r} changed on disk since it was added; add it again to serve the new version"
                )
            entry.host = self._pack(adapter, entry.layout)
        self._touch_host(entry)
        return entry.host

    def _pack(self, adapter: LoraAdapter, layout: AdapterLayout) -> torch.Tensor:
        """The adapter's page images for the host tier, staged by the upload (pinned on CUDA)."""
        _, num_layers, page_elems = self.pool.storage.shape
        images = pack_pages(adapter, layout, num_layers, page_elems, self.pool.storage.dtype)  # [pages, L, P]
        return self.upload.stage(images)

    def _touch_host(self, entry: AdapterEntry) -> None:
        self._host_lru[entry.name] = None
        self._host_lru.move_to_end(entry.name)
        total = sum(self._entries[n].host_bytes for n in self._host_lru)
        for name in list(self._host_lru):
            if total <= self.max_host_bytes or name == entry.name:
                break
            victim = self._entries[name]
            victim.host = None
            total -= victim.host_bytes
            del self._host_lru[name]
