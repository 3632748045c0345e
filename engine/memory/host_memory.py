"""Host memory for the engine on the CPU: large buffers kept in the heap, the page pool on huge pages.

By default glibc serves allocations above a dynamic threshold with fresh ``mmap`` pages and returns
them on free, so every step's multi-megabyte temporaries (gathered K/V, MLP activations, logits) are
page-faulted in again: on the development machine that made the attention gather 2 to 2.6 times
slower. Raising the mmap threshold to glibc's maximum and the trim threshold far above it keeps those
buffers in the heap, where the next step reuses them.

The page pool asks Linux for transparent huge pages (``madvise(MADV_HUGEPAGE)`` before its first touch;
honoured where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``). A decode
step reads each sequence's K/V a page of 16 tokens at a time, a layer's share of a page is a few KB, and
the sequence's next page is anywhere in the pool: the default 2 GiB pool spans 524,288 pages of 4 KB, or
1,024 huge pages, so a long decode step's attention misses the TLB far less
(docs/native-cpu-kernels.md#measurements). The price is paid once, at start-up: Linux zeroes each 2 MB
page (and compacts memory for it when free memory is fragmented) as the pool's zeros first touch it, so
allocating the pool takes longer (docs/benchmarks.md#engine-constants-and-choices).
"""

import ctypes
import ctypes.util
import gc
import logging
import re
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024  # keep up to 1 GiB of freed heap for reuse
MADV_HUGEPAGE = 14  # from Linux's <asm-generic/mman-common.h>
HUGE_PAGE_BYTES = 2 * 1024 * 1024  # x86-64's and arm64's (4 KB granule) transparent huge page
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODES_THAT_ADVISE = ("always", "madvise")  # the modes in which MADV_HUGEPAGE gets huge pages


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name, use_errno=True)


def keep_large_buffers_in_heap() -> bool:
    """Apply the two mallopt settings; False where the C library is not glibc (nothing changes)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    logger.debug("glibc mallopt for large tensor buffers applied: %s", applied)
    return applied


def freeze_startup_heap() -> int:
    """Take every object alive now out of the cyclic garbage collector's walks; the number of objects frozen.

    For a process that serves one engine, called once it is built: the model's, torch's and the tokenizer's
    objects live as long as the process, yet each full collection would walk all of them (hundreds of
    thousands) while every request of the engine waits. Frozen, they are still freed by reference counting; a
    cycle among them is kept for the process's life, which for objects of its start is what happens anyway.
    Not for a process that builds engines and drops them (tests, the gateway's thread engine): their cycles would
    never be collected.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A zeroed CPU tensor of ``shape``, its memory advised for transparent huge pages before the zeros touch
    it (advice given later would only let the kernel's background thread merge pages over time). Returns the
    tensor and whether the advice was given (False off Linux, where the mode is "never", or where madvise
    refused it)."""
    tensor = torch.empty(shape, dtype=dtype)
    advised = advise_huge_pages(tensor)
    tensor.zero_()
    return tensor, advised


def transparent_huge_pages_mode() -> str | None:
    """Linux's transparent huge page mode ("always", "madvise" or "never"); None where there is none."""
    try:
        match = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """``madvise(MADV_HUGEPAGE)`` on the whole huge pages inside ``tensor``'s memory (a CPU tensor), where
    Linux's mode gives huge pages to memory so advised."""
    if sys.platform != "linux" or transparent_huge_pages_mode() not in THP_MODES_THAT_ADVISE:
        return False
    libc = _libc()
    if libc is None:
        return False
    start = tensor.data_ptr()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (start + tensor.numel() * tensor.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= first:
        return False
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(first, end - first, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True
