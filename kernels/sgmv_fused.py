"""SGMV shrink then expand in one call, ``y += (x @ Aᵀ) @ Bᵀ`` per segment: what the engine runs per layer
and module group. On CUDA the two Triton kernels in turn; on CPU one fused torch pass, which needs no
intermediate ``v`` in the separate ops' layout and so makes a few calls per layer instead of one per batch
of equal rank (see :mod:`kernels.sgmv_fused_torch`)."""

import torch

from kernels.lora_metadata import SgmvMetadata
from kernels.sgmv_expand import check_output, sgmv_expand_triton
from kernels.sgmv_fused_torch import SgmvFusedPlan, sgmv_fused_torch
from kernels.sgmv_shrink import check_shrink_inputs, sgmv_shrink_triton


def sgmv_fused(
    x: torch.Tensor,
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    y: torch.Tensor,
    plan: SgmvFusedPlan | None = None,
) -> None:
    """Add each segment's LoRA delta of this layer into y, in place: shrink then expand, fused on CPU.

    Args:
        x: [num_tokens, in_dim], float32, bfloat16 or float16, contiguous; the group's shared input.
        storage: [num_pages, num_layers, P], x's dtype and device, contiguous; the page pool.
        meta: the group's ``SgmvMetadata`` for this step; tensors on x's device.
        layer_offset: ``layer * P``, added to every row address.
        y: [num_tokens, y_width], x's dtype, contiguous; the group's fused output, added to in place.
        plan: the CPU implementation's plan from ``plan_sgmv_fused_torch`` (build it once per step and
            group); None plans on the fly. Ignored on CUDA.

    Semantics: ``sgmv_expand(sgmv_shrink(x, storage, meta, layer_offset), storage, meta, layer_offset, y)``.
    """
    if x.is_cuda:
        sgmv_expand_triton(sgmv_shrink_triton(x, storage, meta, layer_offset), storage, meta, layer_offset, y)
        return
    check_shrink_inputs(x, storage, meta, layer_offset)
    check_output(y, meta)
    if y.dtype != x.dtype:
        raise ValueError(f"y is {y.dtype}, need x's {x.dtype}")
    sgmv_fused_torch(x, storage, meta, layer_offset, y, plan)
