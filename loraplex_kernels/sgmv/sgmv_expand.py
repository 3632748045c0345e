"""SGMV expand: add each segment's rank block times its adapter's Bᵀ rows into y (Punica's expand).

One launch serves a module group (q/k/v, or gate/up) of every segment, whatever the segments' ranks;
each module adds into its own columns of the group's fused output. The kernel reads the shrink's fp32 partial
sums (one per slice of the input columns, see sgmv_shrink) and adds them in slice order, rounding ``v`` to
``y``'s dtype as a stored ``v`` would be: the engine's shrink and expand pass no ``v`` between them.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from loraplex_kernels.sgmv.lora_metadata import MAX_ALIGN, TOKENS_PER_TILE, SgmvMetadata, check_sgmv_metadata
from loraplex_kernels.sgmv.sgmv_shrink import check_pool
from loraplex_kernels.sgmv.sgmv_torch import sgmv_expand_torch
from loraplex_kernels.sgmv.sgmv_torch_plan import SgmvTorchPlan
from loraplex_kernels.triton_launch import TritonLaunch, dot_precision, make_launch, triton_type

# Tile sizes, in one place. tl.dot needs at least 16 along each side (see sgmv_shrink for why a decode
# token still takes a token tile of TOKENS_PER_TILE rows). A rank up to 16 is one inner step, 64 four. Chosen
# for register size, not yet tuned on a GPU.
_RANK_PER_TILE = 16
_OUT_PER_TILE = 64  # output columns per program
_NUM_WARPS = 4

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# num_splits is left generic: one compiled kernel serves every model shape.
@triton.jit(do_not_specialize=["num_splits"])
def _sgmv_expand_kernel(
    v_ptr,  # [num_splits, num_tokens, v_width] fp32: the shrink's partial sums
    storage_ptr,  # [num_pages * num_layers * P], the pool flattened
    y_ptr,  # [num_tokens, y_width], added to in place
    seg_starts_ptr,  # [num_segments + 1] int32
    row_start_ptr,  # [num_segments, num_modules] int32
    ranks_ptr,  # [num_segments, num_modules] int32
    v_cols_ptr,  # [num_segments, num_modules] int32
    row_addr_ptr,  # [num_rows] int64
    tiles_ptr,  # [num_tiles, 2] int32: (segment, first token) of each program along axis 0
    out_dims_ptr,  # [num_modules] int32
    out_offsets_ptr,  # [num_modules] int32
    layer_offset,  # l * P
    num_modules,
    num_splits,
    stride_v,
    stride_split,
    stride_y,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (tf32 would miss 1e-4), ignored for bf16/fp16
    TOKENS_PER_TILE: tl.constexpr,
    RANK_PER_TILE: tl.constexpr,
    OUT_PER_TILE: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # every row address at this layer is a multiple of it (SgmvMetadata.row_align)
    OUT_ALIGN: tl.constexpr,  # every output width and offset is a multiple of it (SgmvMetadata.out_align)
):
    tile = tiles_ptr + tl.program_id(0).to(tl.int64) * 2
    seg = tl.load(tile)
    tile_start = tl.load(tile + 1)
    module = tl.program_id(1)
    first_col = tl.program_id(2) * OUT_PER_TILE
    pair = seg * num_modules + module
    rank = tl.load(ranks_ptr + pair)
    out_dim = tl.multiple_of(tl.load(out_dims_ptr + module), OUT_ALIGN)
    tok_end = tl.load(seg_starts_ptr + seg + 1)
    # skipped pairs, tiles past this module's width and tiles at or past the segment's end exit at once
    if (rank > 0) & (first_col < out_dim) & (tile_start < tok_end):
        row_start = tl.load(row_start_ptr + pair)
        v_col = tl.load(v_cols_ptr + pair)
        y_col = tl.multiple_of(tl.load(out_offsets_ptr + module), OUT_ALIGN)

        o = first_col + tl.arange(0, OUT_PER_TILE)  # [OUT_PER_TILE] columns of this module's output
        o_mask = o < out_dim  # [OUT_PER_TILE]
        tok = tile_start + tl.arange(0, TOKENS_PER_TILE)  # [TOKENS_PER_TILE]
        t_mask = tok < tok_end  # [TOKENS_PER_TILE]
        r = tl.arange(0, RANK_PER_TILE)  # [RANK_PER_TILE]

        v_rows = v_ptr + tok.to(tl.int64)[:, None] * stride_v + v_col  # [TOKENS_PER_TILE, 1]
        acc = tl.zeros([TOKENS_PER_TILE, OUT_PER_TILE], tl.float32)  # [TOKENS_PER_TILE, OUT_PER_TILE]
        for j_start in range(0, rank, RANK_PER_TILE):
            j = j_start + r  # [RANK_PER_TILE] rows of Bᵀ
            j_mask = j < rank  # [RANK_PER_TILE]
            v_mask = t_mask[:, None] & j_mask[None, :]  # [TOKENS_PER_TILE, RANK_PER_TILE]
            v_sum = tl.zeros([TOKENS_PER_TILE, RANK_PER_TILE], tl.float32)  # [TOKENS_PER_TILE, RANK_PER_TILE]
            split_rows = v_rows  # [TOKENS_PER_TILE, 1], the rows in slice 0, then 1, ...
            for _ in range(0, num_splits):
                v_sum += tl.load(split_rows + j[None, :], mask=v_mask, other=0.0)
                split_rows += stride_split
            vs = v_sum.to(y_ptr.dtype.element_ty)  # [TOKENS_PER_TILE, RANK_PER_TILE], v as y's dtype holds it
            addr = tl.load(row_addr_ptr + row_start + j, mask=j_mask, other=0) + layer_offset  # [RANK] i64
            addr = tl.multiple_of(addr, ROW_ALIGN)  # [RANK_PER_TILE]
            b = tl.load(
                storage_ptr + addr[:, None] + o[None, :], mask=j_mask[:, None] & o_mask[None, :], other=0.0
            )  # [RANK_PER_TILE, OUT_PER_TILE]
            acc = tl.dot(vs, b, acc, input_precision=DOT_PRECISION)  # [TOKENS_PER_TILE, OUT_PER_TILE]
        y_ptrs = y_ptr + tok.to(tl.int64)[:, None] * stride_y + (y_col + o)[None, :]  # [TOKENS, OUT]
        y_mask = t_mask[:, None] & o_mask[None, :]  # [TOKENS_PER_TILE, OUT_PER_TILE]
        y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)  # [TOKENS_PER_TILE, OUT_PER_TILE]
        tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


@functools.cache  # a pure function of its arguments: built once per dtype and alignment, not once per layer
def expand_launch(dtype: torch.dtype, row_align: int = MAX_ALIGN, out_align: int = MAX_ALIGN) -> TritonLaunch:
    """The kernel's constexprs, ``num_warps`` and signature for ``dtype``, rows at multiples of ``row_align``
    elements and output widths and offsets multiples of ``out_align``, as ``sgmv_expand_triton`` launches it."""
    t = triton_type(dtype)
    arg_types = {
        "v_ptr": "*fp32",
        **dict.fromkeys(("storage_ptr", "y_ptr"), f"*{t}"),
        **dict.fromkeys(("seg_starts_ptr", "row_start_ptr", "ranks_ptr", "v_cols_ptr"), "*i32"),
        "row_addr_ptr": "*i64",
        **dict.fromkeys(("tiles_ptr", "out_dims_ptr", "out_offsets_ptr"), "*i32"),
        **dict.fromkeys(("layer_offset", "num_modules", "num_splits", "stride_v", "stride_split", "stride_y"), "i32"),
    }
    constexprs = {
        "DOT_PRECISION": dot_precision(dtype),
        "TOKENS_PER_TILE": TOKENS_PER_TILE,
        "RANK_PER_TILE": _RANK_PER_TILE,
        "OUT_PER_TILE": _OUT_PER_TILE,
        "ROW_ALIGN": row_align,
        "OUT_ALIGN": out_align,
    }
    return make_launch(_sgmv_expand_kernel, dtype, arg_types, constexprs, _NUM_WARPS)


def triton_launches() -> tuple[TritonLaunch, ...]:
    """The kernel's launch in every dtype the launcher accepts, aligned as the engine's tables are (the AOT
    compile builds these; a launch for less aligned tables differs only in the compiler's hints)."""
    return tuple(expand_launch(dtype) for dtype in _SUPPORTED_DTYPES)


def expand_grid(meta: SgmvMetadata) -> tuple[int, int, int]:
    """The expand kernel's grid: (token tile, module, tile of OUT_PER_TILE output columns)."""
    return (
        meta.num_tiles,
        meta.num_modules,
        triton.cdiv(max(meta.out_dims), _OUT_PER_TILE),
    )


def sgmv_expand_triton(
    v: torch.Tensor, storage: torch.Tensor, meta: SgmvMetadata, layer_offset: int, y: torch.Tensor
) -> None:
    """Launch the Triton kernel; see ``sgmv_expand`` for the semantics and the arguments."""
    check_expand_inputs(v, storage, meta, layer_offset, y)
    expand_partials(v.float().unsqueeze(0), storage, meta, layer_offset, y)  # v as the one slice of its sums


def expand_partials(
    partials: torch.Tensor, storage: torch.Tensor, meta: SgmvMetadata, layer_offset: int, y: torch.Tensor
) -> None:
    """Add ``v @ Bᵀ`` into ``y`` as ``sgmv_expand`` does, ``v`` given as the shrink's partial sums
    ([num_splits, num_tokens, v_width] fp32, from ``shrink_partials``), added in slice order."""
    if partials.dtype != torch.float32 or partials.dim() != 3 or partials.shape[1:] != (meta.num_tokens, meta.v_width):
        raise ValueError(
            f"partials must be fp32 [num_splits, {meta.num_tokens}, {meta.v_width}], "
            f"got {partials.dtype} {tuple(partials.shape)}"
        )
    check_output(y, meta)
    check_pool(storage, meta, layer_offset, y)
    check_sgmv_metadata(meta, y.device)
    if meta.num_tiles == 0 or meta.max_rank == 0:
        return
    # One program per (token tile, module, tile of OUT_PER_TILE output columns): each owns its
    # block of y, so the read-add-write needs no atomics, and segments of different ranks share the launch
    # (the rank loop runs to each pair's own rank). Tiles past a module's width, of a skipped pair, or past
    # a segment's end return at once. The axes are laid out as in shrink, for the same reason: only axis 0,
    # the token tiles, grows with the step past 65,535.
    launch = expand_launch(y.dtype, math.gcd(meta.row_align, layer_offset), meta.out_align)
    _sgmv_expand_kernel[expand_grid(meta)](
        partials,
        storage,
        y,
        meta.seg_starts,
        meta.row_start_b,
        meta.ranks,
        meta.v_cols,
        meta.row_addr,
        meta.tiles,
        meta.out_dims_table,
        meta.out_offsets_table,
        layer_offset,
        meta.num_modules,
        partials.shape[0],
        partials.stride(1),
        partials.stride(0),
        y.stride(0),
        **launch.constexprs,
        **launch.options(),
    )


def check_output(y: torch.Tensor, meta: SgmvMetadata) -> None:
    """Raise ValueError unless ``y`` is the group's contiguous [num_tokens, y_width] output."""
    if y.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"y must be float32, bfloat16 or float16, got {y.dtype}")
    if y.dim() != 2 or not y.is_contiguous():
        raise ValueError(f"y must be a contiguous [num_tokens, y_width] tensor, got shape {tuple(y.shape)}")
    if tuple(y.shape) != (meta.num_tokens, meta.y_width):
        raise ValueError(f"y must be [num_tokens={meta.num_tokens}, y_width={meta.y_width}], got {tuple(y.shape)}")


def check_expand_inputs(
    v: torch.Tensor, storage: torch.Tensor, meta: SgmvMetadata, layer_offset: int, y: torch.Tensor
) -> None:
    """Raise ValueError unless ``v``, ``y`` and the pool fit ``meta`` (the launcher's checks, also run on CPU)."""
    check_output(y, meta)
    if v.dtype != y.dtype or v.device != y.device:
        raise ValueError(f"v is {v.dtype} on {v.device}, need y's {y.dtype} on {y.device}")
    if v.dim() != 2 or not v.is_contiguous():
        raise ValueError(f"v must be a contiguous [num_tokens, v_width] tensor, got shape {tuple(v.shape)}")
    if tuple(v.shape) != (meta.num_tokens, meta.v_width):
        raise ValueError(f"v must be [num_tokens={meta.num_tokens}, v_width={meta.v_width}], got {tuple(v.shape)}")
    check_pool(storage, meta, layer_offset, y)


def sgmv_expand(
    v: torch.Tensor,
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    y: torch.Tensor,
    plan: SgmvTorchPlan | None = None,
) -> None:
    """Add each segment's rank blocks times its adapter's Bᵀ rows of this layer into y, in place: Triton
    on CUDA, torch on CPU.

    Args:
        v: [num_tokens, v_width], y's dtype, contiguous; the shrink's output.
        storage: [num_pages, num_layers, P], y's dtype and device, contiguous; the page pool.
        meta: the group's ``SgmvMetadata`` for this step; tensors on y's device.
        layer_offset: ``layer * P``, added to every row address.
        y: [num_tokens, y_width], float32, bfloat16 or float16, contiguous; the group's fused output
            (module m owns columns ``out_offsets[m]:out_offsets[m] + out_dims[m]``), added to in place.
        plan: the CPU implementation's plan from ``plan_sgmv_torch`` (build it once per step and group);
            None plans on the fly. Ignored on CUDA.

    Semantics:
        flat = storage.view(-1)
        for s in range(num_segments):
            for m in range(num_modules):
                r = ranks[s, m]                                          # 0: skipped, y untouched
                Bt = [flat[row_addr[row_start_b[s, m] + j] + layer_offset :][:out_dims[m]] for j in range(r)]
                for t in range(seg_starts[s], seg_starts[s + 1]):
                    for o in range(out_dims[m]):
                        y[t, out_offsets[m] + o] += sum_j v[t, v_cols[s, m] + j] * Bt[j][o]    # fp32 sum
    """
    if y.is_cuda:
        sgmv_expand_triton(v, storage, meta, layer_offset, y)
        return
    check_expand_inputs(v, storage, meta, layer_offset, y)
    sgmv_expand_torch(v, storage, meta, layer_offset, y, plan)
