"""Copying an adapter from the host tier into its pages of the pool: in place on CPU, on a side stream on CUDA.

The host tier keeps each adapter as the exact contents of its pages (``[num_pages, num_layers, P]`` in the
pool's dtype, :func:`engine.adapters.adapter_layout.pack_pages`), so loading is one copy per run of consecutive page
ids. On CPU the copy is done when :meth:`AdapterUpload.copy` returns.

On CUDA (docs/architecture.md) the images sit in pinned host memory and :class:`StreamUpload` copies them on a
side stream of its own, so the copy overlaps the compute stream's work:

1. the side stream first waits for the work already enqueued on the compute stream, since the pages it
   overwrites may have been KV blocks or another adapter's rows read by a step still running;
2. the pages are copied with ``non_blocking=True``, then an event is recorded on the side stream;
3. :meth:`AdapterUpload.wait` makes the compute stream wait on that event (a device-side wait; the host
   never blocks). The adapter cache calls it before the first step that reads the adapter, and before
   its pages are freed again;
4. the host images stay referenced until the event has completed, even when the host tier drops them.

The CUDA calls are behind :class:`StreamPrimitives`, so a test on CPU drives this ordering with fakes.
"""

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch


class Event(Protocol):
    """What :class:`StreamUpload` needs of ``torch.cuda.Event``."""

    def record(self, stream: "Stream") -> None: ...

    def query(self) -> bool: ...


class Stream(Protocol):
    """What :class:`StreamUpload` needs of ``torch.cuda.Stream``."""

    def wait_stream(self, stream: "Stream") -> None: ...

    def wait_event(self, event: Event) -> None: ...


class StreamPrimitives(Protocol):
    """The device calls of the CUDA branch: streams, events and pinned memory."""

    def new_stream(self) -> Stream: ...

    def current_stream(self) -> Stream: ...

    def new_event(self) -> Event: ...

    def use_stream(self, stream: Stream) -> AbstractContextManager[object]: ...

    def pin(self, tensor: torch.Tensor) -> torch.Tensor: ...


class AdapterUpload(Protocol):
    """How the adapter cache stages host copies and moves them into the pool."""

    def stage(self, images: torch.Tensor) -> torch.Tensor:
        """The tensor the host tier keeps for ``images`` [num_pages, num_layers, P] (pinned where copies are async)."""
        ...

    def copy(self, storage: torch.Tensor, page_ids: Sequence[int], images: torch.Tensor) -> Event | None:
        """Start copying ``images[i]`` into ``storage[page_ids[i]]``; an event to :meth:`wait` on, or None when done."""
        ...

    def wait(self, copied: Event) -> None:
        """Order the compute stream's next work after the copy that ``copied`` marks."""
        ...


def copy_into_pages(
    storage: torch.Tensor, page_ids: Sequence[int], images: torch.Tensor, non_blocking: bool = False
) -> int:
    """``storage[page_ids[i]] = images[i]`` with one copy per run of consecutive page ids; the number of copies."""
    num_copies = 0
    start = 0
    while start < len(page_ids):
        end = start + 1
        while end < len(page_ids) and page_ids[end] == page_ids[end - 1] + 1:
            end += 1
        first = page_ids[start]
        storage[first : first + end - start].copy_(images[start:end], non_blocking=non_blocking)  # [run, L, P]
        num_copies += 1
        start = end
    return num_copies


class SyncUpload:
    """CPU: the host tier keeps plain tensors and the copy is done before ``copy`` returns."""

    def stage(self, images: torch.Tensor) -> torch.Tensor:
        return images

    def copy(self, storage: torch.Tensor, page_ids: Sequence[int], images: torch.Tensor) -> None:
        copy_into_pages(storage, page_ids, images)
        return None

    def wait(self, copied: Event) -> None:
        """Nothing to order: ``copy`` finished before it returned (and returned no event)."""


class StreamUpload:
    """CUDA: pinned host images copied on a side stream, fenced by an event the compute stream waits on."""

    def __init__(self, cuda: StreamPrimitives) -> None:
        self._cuda = cuda
        self._side: Stream | None = None  # made on first use, so building an engine starts no CUDA work
        self._in_flight: list[tuple[Event, torch.Tensor]] = []  # copies not known to be done, with their source

    @property
    def num_in_flight(self) -> int:
        """Host images still referenced because their copy may not have completed."""
        return len(self._in_flight)

    def stage(self, images: torch.Tensor) -> torch.Tensor:
        return self._cuda.pin(images)

    def copy(self, storage: torch.Tensor, page_ids: Sequence[int], images: torch.Tensor) -> Event:
        self._release_finished()
        if self._side is None:
            self._side = self._cuda.new_stream()
        side = self._side
        side.wait_stream(self._cuda.current_stream())  # the pages' previous owner may still be read
        with self._cuda.use_stream(side):
            copy_into_pages(storage, page_ids, images, non_blocking=True)
            copied = self._cuda.new_event()
            copied.record(side)
        self._in_flight.append((copied, images))
        return copied

    def wait(self, copied: Event) -> None:
        self._cuda.current_stream().wait_event(copied)
        self._release_finished()

    def _release_finished(self) -> None:
        self._in_flight = [(event, images) for event, images in self._in_flight if not event.query()]


class CudaStreams:
    """The real :class:`StreamPrimitives` on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def use_stream(self, stream: torch.cuda.Stream) -> AbstractContextManager[object]:
        return torch.cuda.stream(stream)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()


def make_upload(device: torch.device) -> AdapterUpload:
    """The upload for a pool on ``device``: a side stream on CUDA, plain copies elsewhere."""
    if device.type == "cuda":
        return StreamUpload(CudaStreams(device))
    return SyncUpload()
