"""The native GEMM on AVX512-VNNI's integer dot products: int8 weights against int8-quantized activations.

The dot-product format of int8 projection weights, beside the k-major panels of
loraplex_kernels/projection/linear_packed.py (which widen the weights to fp32 and run fp32 FMAs, on every build). Each
call quantizes its input rows to int8 per block of 32 k (one scale a row and block, as llama.cpp's 8-bit blocks do),
and ``vpdpbusd`` adds four int8 products to an int32 sum in each of sixteen lanes: 64 multiply-adds an instruction
against an FMA's 16, issued as fast as FMAs on the Xeon measured in docs/precision.md. A block's integer sum is exact;
the blocks' sums add up in fp32. The engine times it against the widened panels at load and keeps the
faster (engine/modeling/bf16_gemm.py).

Only a library built with AVX-512 for a CPU with AVX512-VNNI has it (:func:`vnni_available`).
"""

import torch

from loraplex_kernels.native_cpu import native_ops, require_native_ops

BLOCK = 32  # k a block: the activations' quantization group


def vnni_available() -> bool:
    """Whether the native library runs the int8 dot-product panels here (built with AVX-512 and
    AVX512-VNNI, on a CPU that has it)."""
    ops = native_ops()
    return ops is not None and bool(ops.linear_vnni_available())


def pack_linear_quads(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out_features, in_features] int8 packed for :func:`linear_vnni`.

    Returns:
        packed [num_panels, num_blocks * 8, 4 * panel_width] int8 and offsets [num_panels, num_blocks,
        panel_width] int32, with panel_width the build's (loraplex_kernels/projection/linear_packed.py), num_panels =
        ceil(out_features / panel_width) and num_blocks = ceil(in_features / 32); columns past out_features
        and the k past in_features are zero.

    Semantics:
        packed[p, k // 4, 4 * c + k % 4] = weight[p * panel_width + c, k]
        offsets[p, b, c] = -128 * sum_{k in block b} weight[p * panel_width + c, k]
    """
    packed, offsets = require_native_ops().pack_linear_quads(weight)
    return packed, offsets


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations as :func:`linear_vnni` quantizes them (for references and quality checks).

    Args:
        x: [num_rows, in_features] float32.
    Returns:
        q [num_rows, num_blocks * 32] int8 (zero past in_features) and scales [num_rows, num_blocks] float32,
        x[t, k] ~= scales[t, k // 32] * q[t, k]; a block holding a NaN or an infinity has q = 0 and a NaN
        scale, so its row's outputs are NaN.
    """
    rows, in_features = x.shape
    blocks = -(-in_features // BLOCK)
    padded = torch.zeros(rows, blocks * BLOCK, dtype=torch.float32)  # [rows, blocks * 32]
    padded[:, :in_features] = x
    grouped = padded.view(rows, blocks, BLOCK)  # [rows, blocks, 32]
    amax = grouped.abs().amax(dim=2)  # [rows, blocks]
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))  # [rows, blocks]
    q = torch.round(grouped * inv[:, :, None]).to(torch.int8).view(rows, blocks * BLOCK)
    finite = torch.isfinite(grouped).all(dim=2)  # [rows, blocks]
    q = torch.where(finite.repeat_interleave(BLOCK, dim=1), q, torch.zeros_like(q))
    return q, torch.where(finite, amax / 127.0, torch.full_like(amax, float("nan")))


def linear_vnni(
    x: torch.Tensor,
    packed: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    scales: torch.Tensor,
) -> torch.Tensor:
    """``x @ (scales * weight).T + bias`` with x quantized per row and block of 32, on a weight packed by
    :func:`pack_linear_quads`; ValueError where :func:`vnni_available` is false.

    Args:
        x: [num_rows, in_features] float32 on the CPU, rows contiguous.
        packed, offsets: the packed weight.
        bias: [out_features] float32, or None.
        out_features: the weight's rows before packing.
        scales: [out_features] float32: weight[o] = scales[o] * q[o].

    Returns:
        [num_rows, out_features] float32, a new tensor.

    Semantics (xq, xs = :func:`quantize_blocks` of x):
        isum[t, o, b] = sum_{k in block b} xq[t, k] * q[o, k]      (exact int32)
        y[t, o] = scales[o] * sum_b xs[t, b] * isum[t, o, b] + bias[o], the blocks summed in order in fp32
        (one fused multiply-add a block), so a row's result does not depend on the other rows of the batch.
    """
    return require_native_ops().linear_vnni(x, packed, offsets, bias, out_features, scales)  # [rows, out_features]
