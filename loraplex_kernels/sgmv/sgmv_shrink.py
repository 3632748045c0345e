"""SGMV shrink: each segment's tokens times its adapter's A rows, read from the page pool (Punica's shrink).

One launch serves a module group (q/k/v, or gate/up) of every segment, whatever the segments' ranks.
"""

import functools

import torch
import triton
import triton.language as tl

from loraplex_kernels.sgmv.lora_metadata import TOKENS_PER_TILE, SgmvMetadata, check_sgmv_metadata
from loraplex_kernels.sgmv.sgmv_torch import sgmv_shrink_torch
from loraplex_kernels.sgmv.sgmv_torch_plan import SgmvTorchPlan
from loraplex_kernels.triton_launch import TritonLaunch, dot_precision, make_launch, triton_type

# Tile sizes, in one place. tl.dot needs at least 16 along each side, so a decode segment (one token)
# still takes a token tile of TOKENS_PER_TILE rows; its padding rows are masked out of the loads, so they cost
# registers, not memory traffic, and the kernel is bound by reading the A rows anyway. Chosen for register
# size, not yet tuned on a GPU.
_RANK_PER_TILE = 16  # A rows per program: ranks 1..16 take one program, 64 take four
_IN_PER_TILE = 64  # input columns per inner step
_NUM_WARPS = 4

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,  # [num_tokens, in_dim]
    storage_ptr,  # [num_pages * num_layers * P], the pool flattened
    v_ptr,  # [num_tokens, v_width], zero-filled
    seg_starts_ptr,  # [num_segments + 1] int32
    row_start_ptr,  # [num_segments, num_modules] int32
    ranks_ptr,  # [num_segments, num_modules] int32
    v_cols_ptr,  # [num_segments, num_modules] int32
    row_addr_ptr,  # [num_rows] int64
    tiles_ptr,  # [num_tiles, 2] int32: (segment, first token) of each program along axis 0
    layer_offset,  # l * P
    in_dim,
    num_modules,
    stride_x,
    stride_v,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (tf32 would miss 1e-4), ignored for bf16/fp16
    TOKENS_PER_TILE: tl.constexpr,
    RANK_PER_TILE: tl.constexpr,
    IN_PER_TILE: tl.constexpr,
):
    tile = tiles_ptr + tl.program_id(0).to(tl.int64) * 2
    seg = tl.load(tile)
    tile_start = tl.load(tile + 1)
    module = tl.program_id(1)
    first_row = tl.program_id(2) * RANK_PER_TILE
    pair = seg * num_modules + module
    rank = tl.load(ranks_ptr + pair)
    tok_end = tl.load(seg_starts_ptr + seg + 1)
    # skipped pairs, rank tiles past this pair's rank and tiles at or past the segment's end exit at once
    if (first_row < rank) & (tile_start < tok_end):
        row_start = tl.load(row_start_ptr + pair)
        v_col = tl.load(v_cols_ptr + pair)

        j = first_row + tl.arange(0, RANK_PER_TILE)  # [RANK_PER_TILE] rows of A
        j_mask = j < rank  # [RANK_PER_TILE]
        addr = tl.load(row_addr_ptr + row_start + j, mask=j_mask, other=0) + layer_offset  # [RANK_PER_TILE] i64
        tok = tile_start + tl.arange(0, TOKENS_PER_TILE)  # [TOKENS_PER_TILE]
        t_mask = tok < tok_end  # [TOKENS_PER_TILE]
        k = tl.arange(0, IN_PER_TILE)  # [IN_PER_TILE]

        x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_x  # [TOKENS_PER_TILE, 1]
        acc = tl.zeros([TOKENS_PER_TILE, RANK_PER_TILE], tl.float32)  # [TOKENS_PER_TILE, RANK_PER_TILE]
        for k_start in range(0, in_dim, IN_PER_TILE):
            kk = k_start + k  # [IN_PER_TILE]
            k_mask = kk < in_dim  # [IN_PER_TILE]
            xs = tl.load(
                x_rows + kk[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0
            )  # [TOKENS_PER_TILE, IN_PER_TILE]
            a = tl.load(
                storage_ptr + addr[None, :] + kk[:, None], mask=k_mask[:, None] & j_mask[None, :], other=0.0
            )  # [IN_PER_TILE, RANK_PER_TILE], A's rows as columns
            acc = tl.dot(xs, a, acc, input_precision=DOT_PRECISION)  # [TOKENS_PER_TILE, RANK_PER_TILE]
        v_ptrs = v_ptr + tok.to(tl.int64)[:, None] * stride_v + (v_col + j)[None, :]  # [TOKENS, RANK]
        tl.store(v_ptrs, acc.to(v_ptr.dtype.element_ty), mask=t_mask[:, None] & j_mask[None, :])


@functools.cache  # a pure function of the dtype: built once per dtype, not once per layer
def shrink_launch(dtype: torch.dtype) -> TritonLaunch:
    """The kernel's constexprs, ``num_warps`` and signature for ``dtype``, as ``sgmv_shrink_triton`` launches it."""
    t = triton_type(dtype)
    arg_types = {
        **dict.fromkeys(("x_ptr", "storage_ptr", "v_ptr"), f"*{t}"),
        **dict.fromkeys(("seg_starts_ptr", "row_start_ptr", "ranks_ptr", "v_cols_ptr"), "*i32"),
        "row_addr_ptr": "*i64",
        "tiles_ptr": "*i32",
        **dict.fromkeys(("layer_offset", "in_dim", "num_modules", "stride_x", "stride_v"), "i32"),
    }
    constexprs = {
        "DOT_PRECISION": dot_precision(dtype),
        "TOKENS_PER_TILE": TOKENS_PER_TILE,
        "RANK_PER_TILE": _RANK_PER_TILE,
        "IN_PER_TILE": _IN_PER_TILE,
    }
    return make_launch(_sgmv_shrink_kernel, dtype, arg_types, constexprs, _NUM_WARPS)


def triton_launches() -> tuple[TritonLaunch, ...]:
    """Every launch of this module's kernel: one per dtype the launcher accepts (the AOT compile builds these)."""
    return tuple(shrink_launch(dtype) for dtype in _SUPPORTED_DTYPES)


def shrink_grid(meta: SgmvMetadata) -> tuple[int, int, int]:
    """The shrink kernel's grid: (token tile, module, tile of RANK_PER_TILE rows of A)."""
    return (
        meta.num_tiles,
        meta.num_modules,
        triton.cdiv(meta.max_rank, _RANK_PER_TILE),
    )


def sgmv_shrink_triton(x: torch.Tensor, storage: torch.Tensor, meta: SgmvMetadata, layer_offset: int) -> torch.Tensor:
    """Launch the Triton kernel; see ``sgmv_shrink`` for the semantics and the arguments."""
    check_shrink_inputs(x, storage, meta, layer_offset)
    check_sgmv_metadata(meta, x.device)
    v = torch.zeros(meta.num_tokens, meta.v_width, dtype=x.dtype, device=x.device)  # [num_tokens, v_width]
    if meta.num_tiles == 0 or meta.max_rank == 0:
        return v
    # One program per (token tile, module, tile of RANK_PER_TILE rows of A): each reads its rows of A once
    # and writes its own block of v, so no two programs write the same element, and a long segment (a
    # prefill chunk) spreads over as many programs as it has token tiles. Segments of different ranks share
    # the launch: tiles past a pair's rank return at once. Axis 0 holds the token tiles, a segment's side by
    # side so the programs reading one adapter's rows start together: that count grows with the step (a
    # segment of 2^20 tokens alone is 65,536 tiles) and only a grid's x axis goes past 65,535; axes 1 and 2
    # are bounded by the model's shape.
    grid = shrink_grid(meta)
    launch = shrink_launch(x.dtype)
    _sgmv_shrink_kernel[grid](
        x,
        storage,
        v,
        meta.seg_starts,
        meta.row_start_a,
        meta.ranks,
        meta.v_cols,
        meta.row_addr,
        meta.tiles,
        layer_offset,
        meta.in_dim,
        meta.num_modules,
        x.stride(0),
        v.stride(0),
        **launch.constexprs,
        num_warps=launch.num_warps,
    )
    return v


def check_shrink_inputs(
    x: torch.Tensor,
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    storage_dtypes: tuple[torch.dtype, ...] | None = None,
) -> None:
    """Raise ValueError unless ``x`` and the pool fit ``meta`` (the launcher's checks, also run on CPU).

    The pool must be in x's dtype, or in one of ``storage_dtypes`` when given (an op that widens its rows).
    """
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [num_tokens, in_dim] tensor, got shape {tuple(x.shape)}")
    if tuple(x.shape) != (meta.num_tokens, meta.in_dim):
        raise ValueError(f"x must be [num_tokens={meta.num_tokens}, in_dim={meta.in_dim}], got {tuple(x.shape)}")
    check_pool(storage, meta, layer_offset, x, storage_dtypes)


def check_pool(
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    like: torch.Tensor,
    storage_dtypes: tuple[torch.dtype, ...] | None = None,
) -> None:
    """Raise ValueError unless the pool is on ``like``'s device, in its dtype (or one of ``storage_dtypes``
    when given), and holds every row at this layer."""
    dtypes = storage_dtypes or (like.dtype,)
    if storage.dtype not in dtypes or storage.device != like.device:
        need = " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(f"storage is {storage.dtype} on {storage.device}, need {need} on {like.device}")
    if storage.dim() != 3 or not storage.is_contiguous():
        raise ValueError(f"storage must be the contiguous [num_pages, num_layers, P] pool, got {tuple(storage.shape)}")
    if layer_offset < 0 or layer_offset + meta.max_row_end > storage.numel():
        raise ValueError(
            f"layer_offset {layer_offset} puts rows up to element {layer_offset + meta.max_row_end} "
            f"past the pool's {storage.numel()} elements"
        )


def sgmv_shrink(
    x: torch.Tensor,
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    plan: SgmvTorchPlan | None = None,
) -> torch.Tensor:
    """Each segment's tokens times its adapter's A rows of this layer: Triton on CUDA, torch on CPU.

    Args:
        x: [num_tokens, in_dim], float32, bfloat16 or float16, contiguous; the group's shared input.
        storage: [num_pages, num_layers, P], x's dtype and device, contiguous; the page pool.
        meta: the group's ``SgmvMetadata`` for this step; tensors on x's device.
        layer_offset: ``layer * P``, added to every row address.
        plan: the CPU implementation's plan from ``plan_sgmv_torch`` (build it once per step and group);
            None plans on the fly. Ignored on CUDA.

    Returns:
        v: [num_tokens, v_width], x's dtype; zero wherever no (segment, module) writes.

    Semantics:
        flat = storage.view(-1)
        v = zeros(num_tokens, v_width)
        for s in range(num_segments):
            for m in range(num_modules):
                r = ranks[s, m]                                          # 0: skipped
                for j in range(r):
                    row = flat[row_addr[row_start_a[s, m] + j] + layer_offset :][:in_dim]      # A_m[j]
                    for t in range(seg_starts[s], seg_starts[s + 1]):
                        v[t, v_cols[s, m] + j] = sum_i x[t, i] * row[i]                      # fp32 sum
    """
    if x.is_cuda:
        return sgmv_shrink_triton(x, storage, meta, layer_offset)
    check_shrink_inputs(x, storage, meta, layer_offset)
    return sgmv_shrink_torch(x, storage, meta, layer_offset, plan)
