"""The native GEMMs on bf16 dot products: bf16 weights packed with k in pairs, multiplied by AVX512-BF16's
``vdpbf16ps`` or by AMX tiles.

The second panel format for bf16 projection weights, beside the k-major panels of
loraplex_kernels/projection/linear_packed.py (which widen the weights to fp32 and run fp32 FMAs, on every build). Here
the activations are rounded to bf16 once per call and ``vdpbf16ps`` multiplies two k-steps of sixteen columns
in one instruction, summing in fp32: twice the arithmetic of an FMA per instruction, so the faster format
where the CPU issues it about as fast as its FMAs (AMD Zen 4), and the slower one where it does not (the
Xeon measured in docs/precision.md). The engine times both at load and keeps the faster
(engine/modeling/bf16_gemm.py).

Only a library built with AVX-512 for a CPU with AVX512-BF16 has it (:func:`dot_available`). On CPUs with
AMX-BF16 (Intel Sapphire Rapids and later) :func:`linear_amx` multiplies the same panels on the tile unit,
16 rows by 32 k by 16 columns an instruction: about three times the fp32 panels' speed at a full decode
batch where measured (docs/precision.md), so there the engine's bf16 "dot" GEMM is AMX's
(:func:`amx_available`). int8 weights have their own dot-product panels (loraplex_kernels/projection/linear_vnni.py).
"""

import torch

from loraplex_kernels.native_cpu import native_ops, require_native_ops


def dot_available() -> bool:
    """Whether the native library runs the dot-product panels here (built with AVX-512 and AVX512-BF16,
    on a CPU that has it)."""
    ops = native_ops()
    return ops is not None and bool(ops.linear_dot_available())


def amx_available() -> bool:
    """Whether the native library runs AMX tiles on the pair panels here (built for a CPU with AMX-BF16, on
    one that has it, and Linux granted the process the tile state)."""
    ops = native_ops()
    return ops is not None and bool(ops.linear_amx_available())


def pack_linear_pairs(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out_features, in_features] bfloat16 packed for :func:`linear_dot`.

    Returns:
        [num_panels, 16 * ceil(in_features / 32), 2 * panel_width] in ``weight``'s dtype, with panel_width the
        build's (loraplex_kernels/projection/linear_packed.py) and num_panels = ceil(out_features / panel_width);
        columns past out_features and the k past in_features are zero (the pairs run to whole AMX tiles of 16).

    Semantics:
        packed[p, k // 2, 2 * c + k % 2] = weight[p * panel_width + c, k]
    """
    return require_native_ops().pack_linear_pairs(weight)


def linear_dot(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """``bf16(x) @ weight.T + bias`` on a weight packed by :func:`pack_linear_pairs`; ValueError where
    :func:`dot_available` is false.

    Args:
        x: [num_rows, in_features] float32 on the CPU, rows contiguous.
        packed: the packed weight (bfloat16 pair panels).
        bias: [out_features] float32, or None.
        out_features: the weight's rows before packing.

    Returns:
        [num_rows, out_features] float32, a new tensor.

    Semantics:
        xb[t, k] = bf16(x[t, k])  (to nearest, ties to even)
        y[t, o] = bias[o] + sum_{kp} (xb[t, 2kp] * w[o, 2kp] + xb[t, 2kp + 1] * w[o, 2kp + 1]), the pairs
        summed in kp order in fp32 (the products exact; how a pair's two products are added is the CPU's),
        so a row's result does not depend on the other rows of the batch.
    """
    return require_native_ops().linear_dot(x, packed, bias, out_features)  # [num_rows, out_features]


def linear_dot_silu_mul(x: torch.Tensor, packed: torch.Tensor, intermediate: int) -> torch.Tensor:
    """The gated MLP's gate/up projection and SiLU x up in one pass on vdpbf16ps; ValueError where
    :func:`dot_available` is false.

    Args and returns as :func:`linear_amx_silu_mul`'s, with ``intermediate`` a multiple of the panel width
    (48).

    Semantics:
        g, u = linear_dot(x, packed, None, 2 * intermediate).split(intermediate, dim=1)
        out = g / (1 + exp(-g)) * u     (the same bits as silu_mul's native op on that product)
    """
    return require_native_ops().linear_dot_silu_mul(x, packed, intermediate)  # [num_rows, intermediate]


def linear_amx(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """:func:`linear_dot`'s product on AMX tiles; ValueError where :func:`amx_available` is false.

    Args and returns as :func:`linear_dot`'s.

    Semantics:
        y[t, o] = bias[o] + sum_{kp} (xb[t, 2kp] * w[o, 2kp] + xb[t, 2kp + 1] * w[o, 2kp + 1]) with xb as in
        :func:`linear_dot`, the pairs summed in kp order in fp32 by the tile unit (which reads bf16
        subnormals as zero), so a row's result does not depend on the other rows of the batch.
    """
    return require_native_ops().linear_amx(x, packed, bias, out_features)  # [num_rows, out_features]


def linear_amx_silu_mul(x: torch.Tensor, packed: torch.Tensor, intermediate: int) -> torch.Tensor:
    """The gated MLP's gate/up projection and SiLU x up in one pass on AMX tiles.

    Args:
        x: [num_rows, in_features] float32, rows contiguous.
        packed: :func:`pack_linear_pairs` of the fused gate/up weight [2 * intermediate, in_features], gate's
            rows first.
        intermediate: a multiple of 16.
    Returns:
        [num_rows, intermediate] float32.

    Semantics:
        g, u = linear_amx(x, packed, None, 2 * intermediate).split(intermediate, dim=1)
        out = g / (1 + exp(-g)) * u     (the same bits as silu_mul's native op on that product)
    ValueError where :func:`amx_available` is false or the shapes do not match.
    """
    return require_native_ops().linear_amx_silu_mul(x, packed, intermediate)  # [num_rows, intermediate]
