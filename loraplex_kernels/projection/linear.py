"""Dense projections with weights packed once for the CPU's GEMM, in fp32, bf16 or int8.

The layouts, chosen once at load by :meth:`LinearWeight.prepare`:

- NATIVE: the native backend's panels (loraplex_kernels/projection/linear_packed.py). fp32 weights take them where the
  library is built with AVX-512: it overlaps streaming the weights with the arithmetic, which decode
  steps are bound by. bf16 and int8 weights take them on every CPU the library builds for: the panels
  widen them in registers, so a step streams a half or a quarter of the bytes (activations stay fp32).
- NATIVE_DOT: bf16 weights in the native dot-product panels (loraplex_kernels/projection/linear_dot.py: k in pairs,
  activations rounded to bf16, AVX512-BF16's vdpbf16ps), where the engine measured them faster than the
  k-major panels (engine/modeling/bf16_gemm.py).
- NATIVE_AMX: the same k-pair panels of bf16 weights multiplied by AMX tiles
  (loraplex_kernels/projection/linear_dot.py), which take the place of the dot-product panels on CPUs with AMX-BF16.
- NATIVE_VNNI: int8 weights in the native integer dot-product panels (loraplex_kernels/projection/linear_vnni.py: k in
  quads, activations quantized to int8 per row and block of 32, AVX512-VNNI's vpdpbusd), where the engine
  measured them faster than the k-major panels.
- ONEDNN: oneDNN's linear with a weight reordered ahead of time (fp32, or bf16 with bf16 activations);
  on the AVX2 EPYC it ran 1.5 to 2 times faster than the default BLAS call at decode batch sizes (8 to
  128 rows), about 1.3 times at prefill.
- INT8: torch's weight-only int8 matmul (``aten._weight_int8pack_mm``), activations in the model's dtype;
  where the native library is not used.
- PLAIN: the weight as it is and ``F.linear``, on CUDA or where torch lacks oneDNN's op.
"""

import enum
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.layer_ops.silu_mul import silu_mul
from loraplex_kernels.projection.linear_dot import (
    amx_available,
    linear_amx,
    linear_amx_silu_mul,
    linear_dot,
    linear_dot_silu_mul,
    pack_linear_pairs,
)
from loraplex_kernels.projection.linear_packed import (
    linear_packed,
    linear_packed_silu_mul,
    linear_panel_width,
    native_linear_preferred,
    pack_linear_weight,
)
from loraplex_kernels.projection.linear_vnni import linear_vnni, pack_linear_quads

logger = logging.getLogger(__name__)

PACK_BATCH_HINT = 64  # rows oneDNN tunes the packed layout for: a full decode batch
AMX_BLOCK_COLUMNS = 16  # output columns of an AMX sums tile: linear_silu_mul fuses whole blocks
INT8_MAX = 127  # symmetric int8: q in [-127, 127], so -q never overflows
# The native GEMMs of bf16 and int8 weights: k-major panels widened to fp32, or the weight format's dot
# product (bf16: vdpbf16ps; int8: vpdpbusd).
WIDEN, DOT = "widen", "dot"


class WeightLayout(enum.Enum):
    PLAIN = "plain"  # [out_features, in_features], F.linear
    ONEDNN = "onednn"  # oneDNN's reordered weight, its packed linear
    NATIVE = "native"  # the native library's panels, loraplex_kernels/projection/linear_packed.py
    NATIVE_DOT = (
        "native_dot"  # the native library's k-pair panels of bf16 weights, loraplex_kernels/projection/linear_dot.py
    )
    NATIVE_AMX = "native_amx"  # the same k-pair panels on AMX tiles, loraplex_kernels/projection/linear_dot.py
    NATIVE_VNNI = (
        "native_vnni"  # the native library's k-quad panels of int8 weights, loraplex_kernels/projection/linear_vnni.py
    )
    INT8 = "int8"  # [out_features, in_features] int8 and per-row scales, torch's weight-only int8 matmul


@dataclass(frozen=True, slots=True)
class LinearWeight:
    """A projection's weight [out_features, in_features] in one of the layouts, and optional bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    layout: WeightLayout
    out_features: int
    scales: torch.Tensor | None = None  # [out_features] fp32 for int8 weights: weight[o] = scales[o] * q[o]
    offsets: torch.Tensor | None = (
        None  # NATIVE_VNNI: the panels' block offsets (loraplex_kernels/projection/linear_vnni.py)
    )

    @classmethod
    def prepare(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        backend: KernelBackend = KernelBackend.TORCH,
        quantization: str | None = None,
        bf16_gemm: str = WIDEN,
    ) -> "LinearWeight":
        """``weight`` in the fastest layout for ``backend`` here.

        ``weight`` comes in the weight dtype the engine chose (fp32 or bf16); ``quantization="int8"``
        quantizes it per output row. On the NATIVE backend the activations are fp32 whatever the weights,
        so the bias is kept fp32 there, and ``bf16_gemm`` ("widen" or "dot") picks the panels of bf16 and
        int8 weights ("dot" only where loraplex_kernels.projection.linear_dot.dot_available() or amx_available() for
        bf16, AMX tiles where they run; loraplex_kernels.projection.linear_vnni.vnni_available() for int8).
        """
        if bf16_gemm not in (WIDEN, DOT):
            raise ValueError(f"bf16_gemm must be {WIDEN!r} or {DOT!r}, got {bf16_gemm!r}")
        out_features = weight.shape[0]
        native = backend is KernelBackend.NATIVE and weight.device.type == "cpu"
        dot = bf16_gemm == DOT
        if quantization == "int8":
            q, scales = quantize_int8(weight)  # [out, in] int8, [out] fp32
            if native and dot:
                packed, offsets = pack_linear_quads(q)
                return cls(packed, _fp32(bias), WeightLayout.NATIVE_VNNI, out_features, scales, offsets)
            if native:
                return cls(pack_linear_weight(q), _fp32(bias), WeightLayout.NATIVE, out_features, scales)
            return cls(q, bias, WeightLayout.INT8, out_features, scales)
        if quantization is not None:
            raise ValueError(f"quantization must be None or 'int8', got {quantization!r}")
        if native and weight.dtype == torch.bfloat16 and dot:
            layout = WeightLayout.NATIVE_AMX if amx_available() else WeightLayout.NATIVE_DOT
            return cls(pack_linear_pairs(weight), _fp32(bias), layout, out_features)
        if native and weight.dtype == torch.bfloat16:
            return cls(pack_linear_weight(weight), _fp32(bias), WeightLayout.NATIVE, out_features)
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return cls(weight, bias, WeightLayout.PLAIN, out_features)
        if native and weight.dtype == torch.float32 and native_linear_preferred():
            return cls(pack_linear_weight(weight), bias, WeightLayout.NATIVE, out_features)
        if _packing_available(weight.dtype):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
            return cls(packed, bias, WeightLayout.ONEDNN, out_features)
        return cls(weight, bias, WeightLayout.PLAIN, out_features)

    @property
    def weight_bytes(self) -> int:
        """Bytes a pass over the weight reads (scales and offsets included, bias not)."""
        parts = (self.weight, self.scales, self.offsets)
        return sum(part.numel() * part.element_size() for part in parts if part is not None)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: ``weight ~= scales[:, None] * q``.

    Args:
        weight: [out_features, in_features], any float dtype.
    Returns:
        q [out_features, in_features] int8 in [-127, 127], and scales [out_features] fp32
        (max |weight[o]| / 127; a zero row gets scale 1 and zeros).
    """
    w32 = weight.float()  # [out, in]
    scales = w32.abs().amax(dim=1) / INT8_MAX  # [out]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w32 / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)  # [out, in]
    return q, scales


def linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """``y = x @ weight.T + bias``.

    Semantics:
        y[t, o] = sum_i x[t, i] * weight[o, i] + bias[o]     (weight[o] = scales[o] * q[o] for int8)

    Args:
        x: [num_tokens, in_features]: fp32 for the NATIVE* layouts, else the weight's (or the model's) dtype.
        w: a weight prepared by :meth:`LinearWeight.prepare`.
    Returns:
        [num_tokens, out_features] in x's dtype.
    """
    if w.layout is WeightLayout.NATIVE:
        return linear_packed(x, w.weight, w.bias, w.out_features, w.scales)
    if w.layout is WeightLayout.NATIVE_DOT:
        return linear_dot(x, w.weight, w.bias, w.out_features)
    if w.layout is WeightLayout.NATIVE_AMX:
        return linear_amx(x, w.weight, w.bias, w.out_features)
    if w.layout is WeightLayout.NATIVE_VNNI:
        return linear_vnni(x, w.weight, w.offsets, w.bias, w.out_features, w.scales)
    if w.layout is WeightLayout.ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, w.weight, w.bias, "none", [], "")
    if w.layout is WeightLayout.INT8:
        y = torch.ops.aten._weight_int8pack_mm(x, w.weight, w.scales.to(x.dtype))  # [num_tokens, out]
        return y if w.bias is None else y.add_(w.bias)
    return F.linear(x, w.weight, w.bias)


def linear_silu_mul(x: torch.Tensor, gate_up: LinearWeight, backend: KernelBackend) -> torch.Tensor:
    """``silu_mul(linear(x, gate_up), backend)``, in one pass where the weight's GEMM fuses them.

    The native panel GEMMs (k-major panels of fp32, bf16 or int8 weights; bf16 pair panels on vdpbf16ps or
    AMX tiles) compute gate's and up's columns of each panel or block side by side and apply SiLU x up to
    their sums before they leave the thread, the same bits as the two ops; the other layouts, a bias, or an
    intermediate size not whole panels (48 columns with AVX-512, 24 with AVX2; AMX blocks of 16) run the two
    ops.

    Args:
        x: [num_tokens, in_features], as :func:`linear` takes it.
        gate_up: the fused gate/up weight [2 * intermediate, in_features], gate's rows first.
    Returns:
        [num_tokens, intermediate] in x's dtype.
    """
    intermediate = gate_up.out_features // 2
    columns = _fused_gate_up_columns(gate_up.layout)
    if gate_up.bias is not None or columns is None or intermediate % columns != 0:
        return silu_mul(linear(x, gate_up), backend)
    if gate_up.layout is WeightLayout.NATIVE_AMX:
        return linear_amx_silu_mul(x, gate_up.weight, intermediate)
    if gate_up.layout is WeightLayout.NATIVE_DOT:
        return linear_dot_silu_mul(x, gate_up.weight, intermediate)
    return linear_packed_silu_mul(x, gate_up.weight, intermediate, gate_up.scales)


def _fused_gate_up_columns(layout: WeightLayout) -> int | None:
    """Output columns a fused gate/up pass takes at a time on ``layout`` (the intermediate size must be a
    multiple of them), or None where the layout's GEMM has no fused pass."""
    if layout is WeightLayout.NATIVE_AMX:
        return AMX_BLOCK_COLUMNS
    if layout in (WeightLayout.NATIVE, WeightLayout.NATIVE_DOT):
        return linear_panel_width()
    return None


def _fp32(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float()


@functools.cache
def _packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's packed linear runs here in ``dtype`` (bf16 needs a CPU oneDNN computes it on)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        probe = torch.ones(4, 8, dtype=dtype)  # [out, in]
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, 2)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
    except (AttributeError, RuntimeError) as error:
        logger.info("oneDNN packed linear unavailable in %s (%s); using F.linear", dtype, error)
        return False
    return bool(torch.all(out == 8.0))
