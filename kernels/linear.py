"""Dense projections with weights packed once for the CPU's GEMM.

Three layouts, chosen once at load by :meth:`LinearWeight.prepare`:

- NATIVE: the native backend's panels (kernels/linear_packed.py), where the library is built with
  AVX-512: it overlaps streaming the weights with the arithmetic, which decode steps are bound by.
- ONEDNN: oneDNN's linear with a weight reordered ahead of time; on the AVX2 EPYC it ran 1.5 to 2 times
  faster than the default BLAS call at decode batch sizes (8 to 128 rows), about 1.3 times at prefill.
- PLAIN: the weight as it is and ``F.linear``, on CUDA or where torch lacks oneDNN's op.
"""

import enum
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backend import KernelBackend
from kernels.linear_packed import linear_packed, native_linear_preferred, pack_linear_weight

logger = logging.getLogger(__name__)

PACK_BATCH_HINT = 64  # rows oneDNN tunes the packed layout for: a full decode batch


class WeightLayout(enum.Enum):
    PLAIN = "plain"  # [out_features, in_features], F.linear
    ONEDNN = "onednn"  # oneDNN's reordered weight, its packed linear
    NATIVE = "native"  # the native library's panels, kernels/linear_packed.py


@dataclass(frozen=True, slots=True)
class LinearWeight:
    """A projection's weight [out_features, in_features] in one of the layouts, and optional bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    layout: WeightLayout
    out_features: int

    @classmethod
    def prepare(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: KernelBackend = KernelBackend.TORCH
    ) -> "LinearWeight":
        """``weight`` in the fastest layout for ``backend`` here (CPU fp32 only; else as it is)."""
        out_features = weight.shape[0]
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return cls(weight, bias, WeightLayout.PLAIN, out_features)
        if backend is KernelBackend.NATIVE and native_linear_preferred():
            return cls(pack_linear_weight(weight), bias, WeightLayout.NATIVE, out_features)
        if _packing_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
            return cls(packed, bias, WeightLayout.ONEDNN, out_features)
        return cls(weight, bias, WeightLayout.PLAIN, out_features)


def linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """``y = x @ weight.T + bias``.

    Semantics:
        y[t, o] = sum_i x[t, i] * weight[o, i] + bias[o]

    Args:
        x: [num_tokens, in_features], same dtype and device as the weight.
        w: a weight prepared by :meth:`LinearWeight.prepare`.
    Returns:
        [num_tokens, out_features].
    """
    if w.layout is WeightLayout.NATIVE:
        return linear_packed(x, w.weight, w.bias, w.out_features)
    if w.layout is WeightLayout.ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, w.weight, w.bias, "none", [], "")
    return F.linear(x, w.weight, w.bias)


@functools.cache
def _packing_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ones(4, 8)  # [out, in]
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, 2)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), packed, None, "none", [], "")
    except (AttributeError, RuntimeError) as error:
        logger.info("oneDNN packed linear unavailable (%s); using F.linear", error)
        return False
    return bool(torch.all(out == 8.0))
