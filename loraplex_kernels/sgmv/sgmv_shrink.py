"""SGMV shrink: each segment's tokens times its adapter's A rows, read from the page pool (Punica's shrink).

One launch serves a module group (q/k/v, or gate/up) of every segment, whatever the segments' ranks. The
input columns are split into slices of about ``IN_PER_SPLIT`` (split-K), each a program of its own that
writes an fp32 partial sum: a decode step has few token tiles (one per adapter) and a rank of 16 is one
tile, so without the split a group's launch would be a few dozen programs, each walking the whole input
width (8,192 columns for a down projection) alone. The slices follow ``in_dim`` only, and the partial sums
are added in slice order (here, or by the expand kernel as it reads them), so a token's result does not
depend on the rest of the step.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from loraplex_kernels.sgmv.lora_metadata import MAX_ALIGN, TOKENS_PER_TILE, SgmvMetadata, check_sgmv_metadata
from loraplex_kernels.sgmv.sgmv_torch import sgmv_shrink_torch
from loraplex_kernels.sgmv.sgmv_torch_plan import SgmvTorchPlan
from loraplex_kernels.triton_launch import TritonLaunch, dot_precision, make_launch, triton_type

# Tile sizes, in one place. tl.dot needs at least 16 along each side, so a decode segment (one token)
# still takes a token tile of TOKENS_PER_TILE rows; its padding rows are masked out of the loads, so they cost
# registers, not memory traffic, and the kernel is bound by reading the A rows anyway. Chosen for register
# size, not yet tuned on a GPU.
_RANK_PER_TILE = 16  # A rows per program: ranks 1..16 take one program, 64 take four
_IN_PER_TILE = 64  # input columns per inner step
IN_PER_SPLIT = 512  # input columns per program, about: in_dim 2,048 is four slices, 8,192 sixteen
_SPLIT_ALIGN = MAX_ALIGN  # a slice's columns are a multiple of it, so a slice starts where 16-byte loads can
_NUM_WARPS = 4

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# num_rank_tiles and in_per_split are left generic: one compiled kernel serves every step and model shape.
@triton.jit(do_not_specialize=["num_rank_tiles", "in_per_split"])
def _sgmv_shrink_kernel(
    x_ptr,  # [num_tokens, in_dim]
    storage_ptr,  # [num_pages * num_layers * P], the pool flattened
    v_ptr,  # [num_splits, num_tokens, v_width] fp32: each slice's partial sums
    seg_starts_ptr,  # [num_segments + 1] int32
    row_start_ptr,  # [num_segments, num_modules] int32
    ranks_ptr,  # [num_segments, num_modules] int32
    v_cols_ptr,  # [num_segments, num_modules] int32
    row_addr_ptr,  # [num_rows] int64
    tiles_ptr,  # [num_tiles, 2] int32: (segment, first token) of each program along axis 0
    layer_offset,  # l * P
    in_dim,
    in_per_split,  # input columns of a slice (the last may be narrower)
    num_modules,
    num_rank_tiles,  # tiles of RANK_PER_TILE rows in the largest rank: axis 2 is (slice, rank tile)
    stride_x,
    stride_v,
    stride_split,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (tf32 would miss 1e-4), ignored for bf16/fp16
    TOKENS_PER_TILE: tl.constexpr,
    RANK_PER_TILE: tl.constexpr,
    IN_PER_TILE: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # every row address at this layer is a multiple of it (SgmvMetadata.row_align)
    SPLIT_ALIGN: tl.constexpr,  # in_per_split is a multiple of it (split_columns)
    IN_ALIGN: tl.constexpr,  # in_dim is a multiple of it, which divides SPLIT_ALIGN
):
    tile = tiles_ptr + tl.program_id(0).to(tl.int64) * 2
    seg = tl.load(tile)
    tile_start = tl.load(tile + 1)
    module = tl.program_id(1)
    split = tl.program_id(2) // num_rank_tiles
    first_row = (tl.program_id(2) % num_rank_tiles) * RANK_PER_TILE
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
        addr = tl.multiple_of(addr, ROW_ALIGN)  # [RANK_PER_TILE]
        tok = tile_start + tl.arange(0, TOKENS_PER_TILE)  # [TOKENS_PER_TILE]
        t_mask = tok < tok_end  # [TOKENS_PER_TILE]
        k = tl.arange(0, IN_PER_TILE)  # [IN_PER_TILE]
        columns = tl.multiple_of(in_per_split, SPLIT_ALIGN)
        k_begin = split * columns
        k_end = tl.multiple_of(tl.minimum(k_begin + columns, in_dim), IN_ALIGN)

        x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_x  # [TOKENS_PER_TILE, 1]
        acc = tl.zeros([TOKENS_PER_TILE, RANK_PER_TILE], tl.float32)  # [TOKENS_PER_TILE, RANK_PER_TILE]
        for k_start in range(k_begin, k_end, IN_PER_TILE):
            kk = tl.max_contiguous(tl.multiple_of(k_start + k, SPLIT_ALIGN), IN_PER_TILE)  # [IN_PER_TILE]
            k_mask = kk < k_end  # [IN_PER_TILE]
            xs = tl.load(
                x_rows + kk[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0
            )  # [TOKENS_PER_TILE, IN_PER_TILE]
            a = tl.load(
                storage_ptr + addr[None, :] + kk[:, None], mask=k_mask[:, None] & j_mask[None, :], other=0.0
            )  # [IN_PER_TILE, RANK_PER_TILE], A's rows as columns
            acc = tl.dot(xs, a, acc, input_precision=DOT_PRECISION)  # [TOKENS_PER_TILE, RANK_PER_TILE]
        v_rows = v_ptr + split.to(tl.int64) * stride_split + tok.to(tl.int64)[:, None] * stride_v  # [TOKENS, 1]
        tl.store(v_rows + (v_col + j)[None, :], acc, mask=t_mask[:, None] & j_mask[None, :])  # [TOKENS, RANK]


@functools.cache  # a pure function of its arguments: built once per dtype and alignment, not once per layer
def shrink_launch(dtype: torch.dtype, row_align: int = MAX_ALIGN, in_align: int = MAX_ALIGN) -> TritonLaunch:
    """The kernel's constexprs, ``num_warps`` and signature for ``dtype``, rows at multiples of ``row_align``
    elements and an input width that is a multiple of ``in_align``, as ``sgmv_shrink_triton`` launches it.

    The alignments let the compiler read rows and inputs with 16-byte loads staged in shared memory ahead of
    use (``tl.multiple_of``); the launcher passes what holds for the step's tables, so a kernel never assumes
    more than is true."""
    t = triton_type(dtype)
    arg_types = {
        **dict.fromkeys(("x_ptr", "storage_ptr"), f"*{t}"),
        "v_ptr": "*fp32",
        **dict.fromkeys(("seg_starts_ptr", "row_start_ptr", "ranks_ptr", "v_cols_ptr"), "*i32"),
        "row_addr_ptr": "*i64",
        "tiles_ptr": "*i32",
        **dict.fromkeys(
            ("layer_offset", "in_dim", "in_per_split", "num_modules", "num_rank_tiles", "stride_x", "stride_v"),
            "i32",
        ),
        "stride_split": "i32",
    }
    constexprs = {
        "DOT_PRECISION": dot_precision(dtype),
        "TOKENS_PER_TILE": TOKENS_PER_TILE,
        "RANK_PER_TILE": _RANK_PER_TILE,
        "IN_PER_TILE": _IN_PER_TILE,
        "ROW_ALIGN": row_align,
        "SPLIT_ALIGN": _SPLIT_ALIGN,
        "IN_ALIGN": in_align,
    }
    return make_launch(_sgmv_shrink_kernel, dtype, arg_types, constexprs, _NUM_WARPS)


def triton_launches() -> tuple[TritonLaunch, ...]:
    """The kernel's launch in every dtype the launcher accepts, aligned as the engine's tables are (the AOT
    compile builds these; a launch for less aligned tables differs only in the compiler's hints)."""
    return tuple(shrink_launch(dtype) for dtype in _SUPPORTED_DTYPES)


def split_columns(in_dim: int, in_per_split: int = IN_PER_SPLIT) -> int:
    """Input columns per slice: ``in_dim`` cut into ``ceil(in_dim / in_per_split)`` slices of near-equal width
    (SmolLM2's 576 into 288 and 288, not 512 and 64), rounded up to a multiple of 16 columns."""
    near_equal = triton.cdiv(in_dim, triton.cdiv(in_dim, in_per_split))
    return triton.cdiv(near_equal, _SPLIT_ALIGN) * _SPLIT_ALIGN


def shrink_grid(meta: SgmvMetadata, in_per_split: int = IN_PER_SPLIT) -> tuple[int, int, int]:
    """The shrink kernel's grid: (token tile, module, (input slice, tile of RANK_PER_TILE rows of A))."""
    num_splits = triton.cdiv(meta.in_dim, split_columns(meta.in_dim, in_per_split))
    return meta.num_tiles, meta.num_modules, num_splits * triton.cdiv(meta.max_rank, _RANK_PER_TILE)


def shrink_partials(
    x: torch.Tensor,
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    in_per_split: int = IN_PER_SPLIT,
    zeroed: bool = True,
) -> torch.Tensor:
    """The shrink's partial sums, [num_splits, num_tokens, v_width] fp32, one per slice of the input columns:
    ``v`` is their sum in slice order. ``zeroed=False`` leaves what no program writes uninitialised (the expand
    kernel reads only what the shrink wrote)."""
    check_shrink_inputs(x, storage, meta, layer_offset)
    check_sgmv_metadata(meta, x.device)
    columns = split_columns(meta.in_dim, in_per_split)
    num_splits = triton.cdiv(meta.in_dim, columns)
    shape = (num_splits, meta.num_tokens, meta.v_width)
    partials = (torch.zeros if zeroed else torch.empty)(shape, dtype=torch.float32, device=x.device)
    if meta.num_tiles == 0 or meta.max_rank == 0:
        return partials
    # One program per (token tile, module, input slice, tile of RANK_PER_TILE rows of A): each reads its rows
    # of A once over its slice and writes its own block of the slice's partial sums, so no two programs write
    # the same element, and a long segment (a prefill chunk) spreads over as many programs as it has token
    # tiles. Segments of different ranks share the launch: tiles past a pair's rank return at once. Axis 0
    # holds the token tiles, a segment's side by side so the programs reading one adapter's rows start
    # together: that count grows with the step (a segment of 2^20 tokens alone is 65,536 tiles) and only a
    # grid's x axis goes past 65,535; axes 1 and 2 are bounded by the model's shape.
    launch = shrink_launch(x.dtype, math.gcd(meta.row_align, layer_offset), math.gcd(_SPLIT_ALIGN, meta.in_dim))
    _sgmv_shrink_kernel[shrink_grid(meta, in_per_split)](
        x,
        storage,
        partials,
        meta.seg_starts,
        meta.row_start_a,
        meta.ranks,
        meta.v_cols,
        meta.row_addr,
        meta.tiles,
        layer_offset,
        meta.in_dim,
        columns,
        meta.num_modules,
        triton.cdiv(meta.max_rank, _RANK_PER_TILE),
        x.stride(0),
        partials.stride(1),
        partials.stride(0),
        **launch.constexprs,
        **launch.options(),
    )
    return partials


def sgmv_shrink_triton(
    x: torch.Tensor, storage: torch.Tensor, meta: SgmvMetadata, layer_offset: int, in_per_split: int = IN_PER_SPLIT
) -> torch.Tensor:
    """Launch the Triton kernel; see ``sgmv_shrink`` for the semantics and the arguments (``in_per_split``: the
    input columns of a program, about)."""
    partials = shrink_partials(x, storage, meta, layer_offset, in_per_split)  # [num_splits, num_tokens, v_width]
    return partials.sum(0).to(x.dtype)  # [num_tokens, v_width]


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
    if not pool_holds_rows(storage, meta, layer_offset):
        raise ValueError(
            f"layer_offset {layer_offset} puts rows up to element {layer_offset + meta.max_row_end} "
            f"past the pool's {storage.numel()} elements"
        )


def pool_holds_rows(storage: torch.Tensor, meta: SgmvMetadata, layer_offset: int) -> bool:
    """Whether every adapter row ``meta`` names, at the layer that starts at ``layer_offset``, is inside the pool."""
    return layer_offset >= 0 and layer_offset + meta.max_row_end <= storage.numel()


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
