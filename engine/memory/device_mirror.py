"""Tensors that a CUDA graph reads, written on the host and moved to the device in one copy.

A CUDA graph reads its inputs at the addresses it was captured with, so a step's inputs go into the same
device tensors every step. A :class:`DeviceMirror` lays out named tensors in one device buffer and the same
layout in one pinned host buffer: a step writes the host views (torch copies on the host, no kernel launch)
and :meth:`DeviceMirror.upload` moves the buffer with one non-blocking copy, queued before the graph's
replay on the same stream. The fields lie in the order they are named, so a step that uses only the first
elements of the last field moves only up to them (:meth:`DeviceMirror.end_of`). On a CPU the two buffers are
one and ``upload`` does nothing.

The host buffer must not be written while its last upload is in flight: a step launched ahead of the host
(engine/step/launch_ahead.py) writes it before the engine has waited for the step before. So
:attr:`DeviceMirror.host` first waits for the event recorded after the last copy, which completes as soon as
the device has made the copy, ahead of the forward pass that reads it.
"""

import itertools

import torch

from engine.memory.host_to_device import ALIGN_BYTES

FieldSpec = tuple[tuple[int, ...], torch.dtype]  # a tensor's shape and dtype


class DeviceMirror:
    """Named tensors in one device buffer (``device``) and their host twins (``host``), zero at first."""

    def __init__(self, fields: dict[str, FieldSpec], device: torch.device):
        sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in fields.values()]
        starts = list(itertools.accumulate((-(-size // ALIGN_BYTES) * ALIGN_BYTES for size in sizes), initial=0))
        self._device_buffer = torch.zeros(starts[-1], dtype=torch.uint8, device=device)  # [num_bytes]
        on_cpu = device.type == "cpu"
        self._host_buffer = (
            self._device_buffer if on_cpu else torch.zeros(starts[-1], dtype=torch.uint8, pin_memory=True)
        )  # [num_bytes]

        def views(buffer: torch.Tensor) -> dict[str, torch.Tensor]:
            return {
                name: buffer[start : start + size].view(dtype).view(shape)
                for (name, (shape, dtype)), start, size in zip(fields.items(), starts, sizes, strict=False)
            }

        self.device = views(self._device_buffer)
        self._host = views(self._host_buffer)
        self._starts = dict(zip(fields, starts, strict=False))  # each field's first byte
        self._copied: torch.cuda.Event | None = None  # recorded after the last upload (CUDA)

    @property
    def host(self) -> dict[str, torch.Tensor]:
        """The host views, to write once the last upload has been copied (waits for it on CUDA)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self._host

    def end_of(self, name: str, num_elements: int) -> int:
        """The byte just past the first ``num_elements`` elements of field ``name`` (in its memory order)."""
        return self._starts[name] + num_elements * self._host[name].element_size()

    def upload(self, end: int | None = None) -> None:
        """Queue the copy of the host buffer to the device's, whole or its bytes before ``end`` (nothing on a
        CPU)."""
        if self._host_buffer is not self._device_buffer:
            self._device_buffer[:end].copy_(self._host_buffer[:end], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
