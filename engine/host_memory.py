"""Keep glibc from handing large tensor buffers back to the kernel after every use (CPU only).

By default glibc serves allocations above a dynamic threshold with fresh ``mmap`` pages and returns
them on free, so every step's multi-megabyte temporaries (gathered K/V, MLP activations, logits) are
page-faulted in again: on the development machine that made the attention gather 2 to 2.6 times
slower. Raising the mmap threshold to glibc's maximum and the trim threshold far above it keeps those
buffers in the heap, where the next step reuses them.
"""

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024  # keep up to 1 GiB of freed heap for reuse


def keep_large_buffers_in_heap() -> bool:
    """Apply the two mallopt settings; False where the C library is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    logger.debug("glibc mallopt for large tensor buffers applied: %s", applied)
    return applied
