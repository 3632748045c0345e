"""Adapter uploads: the CUDA branch (pinned host copies, a side stream, an event the compute stream waits on)
driven on the CPU with fakes for the stream, event and pinning calls only; the copies themselves are real.
And the CPU branch: the host tier holds page images, and a load puts exactly the adapter's rows in its pages."""

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine.adapters import adapter_upload
from engine.adapters.adapter_cache import AdapterCache
from engine.adapters.adapter_layout import write_adapter
from engine.adapters.adapter_upload import StreamUpload, SyncUpload, copy_into_pages, make_upload
from engine.adapters.lora_adapter import load_lora_adapter
from engine.config import ModelConfig
from engine.errors import AdapterMismatchError
from engine.memory.page_pool import PagePool
from tests.engine.lora_helpers import make_peft_adapter

NUM_POOL_PAGES = 64


class FakeEvent:
    """Records where it is recorded; ``done`` says whether the device has passed it. No host wait exists."""

    def __init__(self, cuda: "FakeCuda", name: str) -> None:
        self.cuda = cuda
        self.name = name
        self.done = False

    def record(self, stream: "FakeStream") -> None:
        self.cuda.log.append(("record", self.name, stream.name))
        self.cuda.on_record()

    def query(self) -> bool:
        return self.done


class FakeStream:
    def __init__(self, cuda: "FakeCuda", name: str) -> None:
        self.cuda = cuda
        self.name = name

    def wait_stream(self, stream: "FakeStream") -> None:
        self.cuda.log.append(("wait_stream", self.name, stream.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait_event", self.name, event.name))


class FakeCuda:
    """The StreamPrimitives of the CUDA branch, logging every call in order; it offers no synchronize."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.compute = FakeStream(self, "compute")
        self.active = self.compute
        self.events: list[FakeEvent] = []
        self.pinned: list[weakref.ref] = []
        self.on_record: Callable[[], None] = lambda: None

    def new_stream(self) -> FakeStream:
        self.log.append(("new_stream",))
        return FakeStream(self, "side")

    def current_stream(self) -> FakeStream:
        return self.active

    def new_event(self) -> FakeEvent:
        self.events.append(FakeEvent(self, f"event{len(self.events)}"))
        return self.events[-1]

    @contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        self.log.append(("enter", stream.name))
        self.active = stream
        try:
            yield
        finally:
            self.active = self.compute
            self.log.append(("exit", stream.name))

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.clone()  # pin_memory() returns a new tensor too
        self.pinned.append(weakref.ref(pinned))
        self.log.append(("pin",))
        return pinned

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return any(ref() is tensor for ref in self.pinned)


def test_copy_is_on_the_side_stream_after_compute_and_before_its_event(monkeypatch: pytest.MonkeyPatch) -> None:
    storage = torch.zeros(8, 2, 16)  # [pages, layers, P]
    images = torch.randn(3, 2, 16)  # [adapter pages, layers, P]
    page_ids = [5, 6, 2]
    cuda = FakeCuda()
    copies: list[tuple[str, bool]] = []  # each page copy: the stream active then, and non_blocking

    def recording_copy(storage, page_ids, images, non_blocking=False):
        copies.append((cuda.active.name, non_blocking))
        return copy_into_pages(storage, page_ids, images, non_blocking)

    monkeypatch.setattr(adapter_upload, "copy_into_pages", recording_copy)
    upload = StreamUpload(cuda)
    at_record = []
    cuda.on_record = lambda: at_record.append(storage[page_ids].clone())

    staged = upload.stage(images)
    assert cuda.is_pinned(staged) and torch.equal(staged, images)
    event = upload.copy(storage, page_ids, staged)

    assert cuda.log == [
        ("pin",),
        ("new_stream",),
        ("wait_stream", "side", "compute"),  # the pages' last readers on the compute stream come first
        ("enter", "side"),
        ("record", "event0", "side"),
        ("exit", "side"),
    ]
    assert copies == [("side", True)]  # issued on the side stream, asynchronously
    assert torch.equal(at_record[0], images), "the event must be recorded after the copy"
    assert event is cuda.events[0]
    upload.wait(event)
    assert cuda.log[-1] == ("wait_event", "compute", "event0")
    upload.copy(storage, [0], staged[:1])
    assert cuda.log.count(("new_stream",)) == 1, "one side stream serves every upload"


def test_host_images_live_until_their_copy_is_done() -> None:
    cuda = FakeCuda()
    upload = StreamUpload(cuda)
    storage = torch.zeros(4, 2, 16)  # [pages, layers, P]
    staged = upload.stage(torch.randn(2, 2, 16))
    alive = weakref.ref(staged)
    event = upload.copy(storage, [1, 2], staged)
    del staged  # the host tier drops its copy while the device may still read it
    gc.collect()
    assert alive() is not None and upload.num_in_flight == 1
    upload.wait(event)  # the compute stream waits; the copy is still running
    gc.collect()
    assert alive() is not None
    cuda.events[0].done = True
    upload.wait(event)
    gc.collect()
    assert alive() is None and upload.num_in_flight == 0


def test_copy_into_pages_copies_runs_of_consecutive_pages() -> None:
    storage = torch.zeros(10, 2, 4)  # [pages, layers, P]
    images = torch.randn(5, 2, 4)  # [adapter pages, layers, P]
    page_ids = [3, 4, 5, 9, 0]
    assert copy_into_pages(storage, page_ids, images) == 3
    assert torch.equal(storage[page_ids], images)
    untouched = [p for p in range(10) if p not in page_ids]
    assert not storage[untouched].any()


def test_make_upload_picks_the_stream_upload_on_cuda_without_touching_the_device() -> None:
    assert isinstance(make_upload(torch.device("cpu")), SyncUpload)
    assert isinstance(make_upload(torch.device("cuda")), StreamUpload)  # no CUDA call until the first copy


@pytest.fixture(scope="module")
def adapter_folders(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("upload-adapters")
    return [
        make_peft_adapter(tiny_llama, root / "a0", seed=7, r=4, target_modules=["q_proj", "down_proj"]),
        make_peft_adapter(tiny_llama, root / "a1", seed=8, r=8, target_modules="all-linear"),
    ]


def _cache(tiny_llama: Path, upload=None, max_host_bytes: int = 1 << 30) -> AdapterCache:
    model = ModelConfig.from_folder(tiny_llama)
    block_size = model.pick_block_size()
    pool = PagePool(
        NUM_POOL_PAGES,
        model.num_layers,
        block_size,
        model.num_kv_heads,
        model.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    pool.storage.normal_()  # stale data everywhere: a load must overwrite its pages whole
    return AdapterCache(pool, model, max_host_bytes, upload)


def _expected_pages(cache: AdapterCache, folder: Path, page_ids: list[int]) -> torch.Tensor:
    """What the adapter's pages hold when its rows are written one by one (zeros where no row lies)."""
    reference = torch.zeros_like(cache.pool.storage)  # [pages, layers, P]
    adapter = load_lora_adapter(folder, cache.model)
    write_adapter(reference, page_ids, adapter, cache.get(folder.name).layout)
    return reference[page_ids]


def test_cuda_branch_through_the_cache_waits_before_first_use_and_before_eviction(
    tiny_llama: Path, adapter_folders: list[Path]
) -> None:
    cuda = FakeCuda()
    cache = _cache(tiny_llama, StreamUpload(cuda))
    entries = [cache.add(folder.name, folder) for folder in adapter_folders]
    assert all(cuda.is_pinned(entry.host) for entry in entries), "the host tier keeps pinned copies"

    cache.pin("a0")  # loaded ahead of use: the copy is pending, nobody waits yet
    first = entries[0]
    assert first.copying is cuda.events[0]
    assert not any(step[0] == "wait_event" for step in cuda.log)
    assert torch.equal(cache.pool.storage[first.page_ids], _expected_pages(cache, adapter_folders[0], first.page_ids))

    assert cache.acquire(first)  # its first sequence runs in the step being scheduled
    assert cuda.log[-1] == ("wait_event", "compute", "event0") and first.copying is None
    num_steps = len(cuda.log)
    assert cache.acquire(first)  # later users are ordered after that wait already
    assert len(cuda.log) == num_steps

    second = entries[1]
    cache.pin("a1")
    cache.pin("a1", pinned=False)  # idle with its copy pending: evicting it must wait for the copy
    num_pages = len(second.page_ids)
    assert cache.reclaim(num_pages) == num_pages
    assert cuda.log[-1] == ("wait_event", "compute", "event1") and not second.is_resident
    assert all(
        step[0] in {"pin", "new_stream", "wait_stream", "enter", "exit", "record", "wait_event"} for step in cuda.log
    )


def test_cpu_branch_loads_pages_and_rereads_a_dropped_host_copy(
    tiny_llama: Path, adapter_folders: list[Path], tmp_path: Path
) -> None:
    cache = _cache(tiny_llama, max_host_bytes=1)  # room for no host copy but the one in use
    assert isinstance(cache.upload, SyncUpload)
    first, second = (cache.add(folder.name, folder) for folder in adapter_folders)
    assert first.host is None and second.host is not None, "the least recently used host copy is dropped"
    assert first.host_bytes == first.layout.num_pages * cache.pool.storage[0].numel() * 4

    assert cache.acquire(first)  # read again from disk, packed, copied
    assert first.copying is None
    assert torch.equal(cache.pool.storage[first.page_ids], _expected_pages(cache, adapter_folders[0], first.page_ids))
    assert first.row_addr.device.type == "cpu" and first.row_addr_list == first.row_addr.tolist()

    cache.release(first)
    cache.reclaim(len(first.page_ids))
    assert cache.acquire(second)  # drops first's host copy again
    changed = make_peft_adapter(tiny_llama, tmp_path / "a0", seed=99, r=4, target_modules=["q_proj", "down_proj"])
    first.path = changed
    with pytest.raises(AdapterMismatchError, match="changed on disk"):
        cache.acquire(first)
