"""The gated MLP's activation: SiLU of the gate times the up projection, from their fused output."""

import torch
import torch.nn.functional as F

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import require_native_ops


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch implementation of :func:`silu_mul` (same semantics)."""
    gate, up = gate_up.chunk(2, dim=-1)  # 2 x [num_tokens, intermediate]
    return F.silu(gate).mul_(up)  # [num_tokens, intermediate]


def silu_mul(gate_up: torch.Tensor, backend: KernelBackend = KernelBackend.TORCH) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` holds gate then up along its last dim.

    Args:
        gate_up: [num_tokens, 2 * intermediate], rows contiguous (the fused gate/up projection).
        backend: NATIVE runs the C++ op (float32 CPU); TORCH and TRITON (no Triton kernel here) the torch ops.

    Returns:
        [num_tokens, intermediate], a new tensor.

    Semantics:
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
        out = gate / (1 + exp(-gate)) * up
    """
    if backend is KernelBackend.NATIVE:
        return require_native_ops().silu_mul(gate_up)  # [num_tokens, intermediate]
    return silu_mul_torch(gate_up)
