"""The native GEMM for projections: weights packed once into column panels, every batch size.

Where it runs: the native backend on a CPU the library is built for with AVX-512 (panels of 48 columns),
where a decode step's projections and LM head, bound by streaming the weights from memory, run faster
than oneDNN's packed GEMM, and prefill steps about as fast (docs/native-cpu-kernels.md#measurements). On
AVX2 it builds and passes the same tests (panels of 24 columns) but has not been measured against oneDNN
there, so the engine keeps oneDNN on such CPUs for fp32 weights.

Panels may hold bf16 or int8 weights (per-output-column scales beside them): each panel row is widened
to fp32 in registers as it is loaded and the arithmetic is the fp32 tile's, so a decode step streams a
half or a quarter of the bytes. On every x86 build (AVX-512, AVX2, or plain loops elsewhere). Where the
CPU has AVX512-BF16, loraplex_kernels/projection/linear_dot.py holds the same weights in a second format for its dot
products.
"""

import functools

import torch

from loraplex_kernels.native_cpu import native_ops, require_native_ops

PREFERRED_PANEL_WIDTH = 48  # the AVX-512 build's panels: the one measured faster than oneDNN


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out_features, in_features] (float32, bfloat16 or int8) packed for :func:`linear_packed`.

    Returns:
        [num_panels, in_features, panel_width] in ``weight``'s dtype, with panel_width this build's (48
        on AVX-512, 24 on AVX2) and num_panels = ceil(out_features / panel_width); columns past out_features are zero.

    Semantics:
        packed[p, k, c] = weight[p * panel_width + c, k]
    """
    return require_native_ops().pack_linear_weight(weight)


def linear_packed(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` on a weight packed by :func:`pack_linear_weight`.

    Args:
        x: [num_rows, in_features] float32 on the CPU, rows contiguous.
        packed: the packed weight (float32, bfloat16 or int8 panels).
        bias: [out_features] float32, or None.
        out_features: the weight's rows before packing.
        scales: [out_features] float32 with int8 panels (and only then): weight[o] = scales[o] * q[o].

    Returns:
        [num_rows, out_features], a new tensor.

    Semantics:
        y[t, o] = bias[o] + sum_k x[t, k] * weight[o, k], summed in k order in fp32 (one FMA chain per
        output), so a row's result does not depend on the other rows of the batch; with int8 panels
        y[t, o] = bias[o] + scales[o] * sum_k x[t, k] * q[o, k].
    """
    return require_native_ops().linear_packed(x, packed, bias, out_features, scales)  # [num_rows, out_features]


def linear_packed_silu_mul(
    x: torch.Tensor, packed: torch.Tensor, intermediate: int, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """The gated MLP's gate/up projection and SiLU x up in one pass on the panels of :func:`pack_linear_weight`.

    Args:
        x: [num_rows, in_features] float32 on the CPU, rows contiguous.
        packed: the packed fused gate/up weight [2 * intermediate, in_features], gate's rows first.
        intermediate: a multiple of the panel width (``linear_panel_width()``: 48 with AVX-512, 24 with AVX2).
        scales: [2 * intermediate] float32 with int8 panels (and only then).
    Returns:
        [num_rows, intermediate] float32.

    Semantics:
        g, u = linear_packed(x, packed, None, 2 * intermediate, scales).split(intermediate, dim=1)
        out = g / (1 + exp(-g)) * u     (the same bits as silu_mul's native op on that product)
    """
    return require_native_ops().linear_packed_silu_mul(x, packed, intermediate, scales)  # [num_rows, intermediate]


@functools.cache
def linear_panel_width() -> int:
    """Output columns of a native panel: 48 where the library is built with AVX-512, 24 with AVX2."""
    return require_native_ops().linear_panel_width()


@functools.cache
def native_linear_preferred() -> bool:
    """Whether the native library is built here with the panels measured faster than oneDNN (AVX-512)."""
    ops = native_ops()
    return ops is not None and ops.linear_panel_width() == PREFERRED_PANEL_WIDTH
