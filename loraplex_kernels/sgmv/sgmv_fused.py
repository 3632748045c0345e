"""SGMV shrink then expand in one call, ``y += (x @ Aᵀ) @ Bᵀ`` per segment: what the engine runs per layer
and module group. The Triton backend launches the two Triton kernels in turn, the shrink's fp32 partial sums
passed straight to the expand; the native one the C++ op (one call reading the pool in place, see
:mod:`loraplex_kernels.sgmv.sgmv_fused_native`); the torch one a fused torch pass, which needs no intermediate
``v`` in the separate ops' layout and so makes a few calls per layer instead of one per batch of equal rank
(see :mod:`loraplex_kernels.sgmv.sgmv_fused_torch`)."""

import torch

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.sgmv.lora_metadata import SgmvMetadata
from loraplex_kernels.sgmv.sgmv_expand import check_output, expand_partials
from loraplex_kernels.sgmv.sgmv_fused_native import NATIVE_STORAGE_DTYPES, SgmvNativePlan, sgmv_fused_native
from loraplex_kernels.sgmv.sgmv_fused_torch import SgmvFusedPlan, sgmv_fused_torch
from loraplex_kernels.sgmv.sgmv_shrink import check_shrink_inputs, shrink_partials


def sgmv_fused(
    x: torch.Tensor,
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    y: torch.Tensor,
    plan: SgmvFusedPlan | SgmvNativePlan | None = None,
    backend: KernelBackend = KernelBackend.TORCH,
) -> None:
    """Add each segment's LoRA delta of this layer into y, in place: shrink then expand (fused but for TRITON).

    Args:
        x: [num_tokens, in_dim], float32, bfloat16 or float16, contiguous; the group's shared input.
        storage: [num_pages, num_layers, P], x's dtype and device, contiguous; the page pool. NATIVE also
            takes a bfloat16 pool beside float32 x (bf16 mode's pool: its rows widened as they are read).
        meta: the group's ``SgmvMetadata`` for this step; tensors on x's device.
        layer_offset: ``layer * P``, added to every row address.
        y: [num_tokens, y_width], x's dtype, contiguous; the group's fused output, added to in place.
        plan: the TORCH or NATIVE backend's plan, from ``plan_sgmv_fused_torch`` or ``plan_sgmv_native``
            (build it once per step and group); None plans on the fly. TRITON needs none and ignores it.
        backend: the implementation, the engine's resolved ``kernels`` setting (NATIVE: float32 on CPU).

    Semantics: ``sgmv_expand(sgmv_shrink(x, storage, meta, layer_offset), storage, meta, layer_offset, y)``.
    """
    if y.dtype != x.dtype:
        raise ValueError(f"y is {y.dtype}, need x's {x.dtype}")
    if backend is KernelBackend.TRITON:
        partials = shrink_partials(x, storage, meta, layer_offset, zeroed=False)  # [num_splits, num_tokens, v_width]
        expand_partials(partials, storage, meta, layer_offset, y)
        return
    native = backend is KernelBackend.NATIVE
    check_shrink_inputs(x, storage, meta, layer_offset, NATIVE_STORAGE_DTYPES if native else None)
    check_output(y, meta)
    if native:
        if plan is not None and not isinstance(plan, SgmvNativePlan):
            raise ValueError("the native backend takes a plan from plan_sgmv_native")
        sgmv_fused_native(x, storage, meta, layer_offset, y, plan)
        return
    if plan is not None and not isinstance(plan, SgmvFusedPlan):
        raise ValueError("the torch backend takes a plan from plan_sgmv_fused_torch")
    sgmv_fused_torch(x, storage, meta, layer_offset, y, plan)
