"""Greedy choice: the index of each row's largest logit."""

import torch

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import require_native_ops


def argmax_rows(logits: torch.Tensor, backend: KernelBackend = KernelBackend.TORCH) -> torch.Tensor:
    """The index of each row's maximum, as ``logits.argmax(dim=-1)``.

    Args:
        logits: [num_rows, vocab]; NATIVE needs float32 on the CPU with contiguous rows.
        backend: NATIVE runs the C++ op (a vector pass per row, rows over the threads; faster than torch's
            reduction: docs/native-cpu-kernels.md#measurements); TORCH and TRITON run torch's argmax.

    Returns:
        [num_rows] int64.

    Semantics:
        out[r] = min(i for i in range(vocab) if logits[r, i] == max(logits[r]))   # the first maximum
        out[r] = the first i where logits[r, i] is NaN, when row r holds a NaN     # as torch
    """
    if backend is KernelBackend.NATIVE and logits.dtype == torch.float32 and logits.device.type == "cpu":
        return require_native_ops().argmax_rows(logits)  # [num_rows]
    return logits.argmax(dim=-1)  # [num_rows]
