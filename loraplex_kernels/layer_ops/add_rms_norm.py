"""Residual add fused with RMSNorm: the glue before each projection group of a decoder layer."""

import torch

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import require_native_ops


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Torch implementation of :func:`add_rms_norm` (same semantics)."""
    if residual is not None:
        x.add_(residual)  # [num_tokens, hidden], in place
    x32 = x.float()  # [num_tokens, hidden]
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [num_tokens, hidden]
    return weight * x32.to(x.dtype)  # [num_tokens, hidden]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    backend: KernelBackend = KernelBackend.TORCH,
) -> torch.Tensor:
    """Add ``residual`` into the residual stream ``x`` in place, and return the stream RMS-normalised.

    The math is fp32, as Hugging Face's Llama does it.

    Args:
        x: [num_tokens, hidden], contiguous; updated in place when ``residual`` is given.
        residual: [num_tokens, hidden] like ``x``, or None (just the norm).
        weight: [hidden], same dtype as ``x``.
        eps: added to the mean square.
        backend: NATIVE runs the C++ op (float32 CPU tensors); TORCH and TRITON (no Triton kernel here) the torch ops.

    Returns:
        [num_tokens, hidden], a new tensor.

    Semantics:
        if residual is not None:
            x += residual
        out = weight * (x * rsqrt(mean(x ** 2, dim=-1) + eps))
    """
    if backend is KernelBackend.NATIVE:
        return require_native_ops().add_rms_norm(x, residual, weight, eps)  # [num_tokens, hidden]
    return add_rms_norm_torch(x, residual, weight, eps)
