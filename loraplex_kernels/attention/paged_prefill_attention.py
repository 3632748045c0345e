"""Paged attention for prefill chunks on tensor cores: query segments of at least MIN_TILED_ROWS rows.

The same problem as ``loraplex_kernels.attention.paged_attention`` (each query row attends causally to its sequence's
keys, read page by page through the block table), solved a tile of query rows at a time: ``tl.dot`` of the Q tile
against a tile of keys, online softmax in log2 units, the causal mask applied inside the tile, then
``tl.dot`` of the probabilities against the V tile. ``paged_attention_triton`` routes the rows: segments of
MIN_TILED_ROWS rows or more come here, shorter ones (decode rows, short chunks) to the row kernel.
"""

import functools
import itertools
import math

import torch
import triton
import triton.language as tl

from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata
from loraplex_kernels.attention.kv_tile import attend_kv_tile, load_kv_tile
from loraplex_kernels.triton_launch import (
    AOT_ATTENTION_SHAPE,
    ATTENTION_STRIDE_ARGS,
    TritonLaunch,
    dot_precision,
    make_launch,
    triton_type,
)

# A segment this long fills the 16 rows of a tensor-core product (mma's M) with its own query tokens; a
# shorter one (a decode row, the tail of a prompt) is the row kernel's.
MIN_TILED_ROWS = 16
# Rows of the Q tile: query tokens × the kv head's group of query heads, stacked token-major, so the
# group shares every K/V tile (SmolLM2, group 3: 21 tokens, 63 live rows). A group wider than this takes
# a wider tile of one token.
_ROWS_PER_TILE = 64
# Keys per inner step; a tile may span several pages (each key finds its own page), so it is independent
# of block_size. Chosen for register size, not yet tuned on a GPU: at SmolLM2's head_dim 64, 4 warps
# spill (255 registers and a 640-byte stack in fp32 on sm_80, per ptxas), 8 warps hold the [64, 64] Q tile
# and accumulator and the [64, 32] scores without spilling in every dtype on sm_80 and sm_90.
_KEYS_PER_TILE = 32
_NUM_WARPS = 8
_LOG2_E = math.log2(math.e)

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _paged_prefill_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    kv_ptr,  # [num_pages, 2, block_size, num_kv_heads, head_dim], strided
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32, strided
    tiles_ptr,  # [num_tiles, 2] int32: (first query row, sequence) of each tile
    scale_log2,  # softmax scale × log2(e): scores are exponentiated with exp2
    stride_q_token,
    stride_q_head,
    stride_kv_page,
    stride_kv_kind,
    stride_kv_slot,
    stride_kv_head,
    stride_out_token,
    stride_out_head,
    stride_bt_seq,
    stride_bt_block,
    group: tl.constexpr,  # query heads per kv head
    head_dim: tl.constexpr,
    block_size: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # head_dim rounded up to a power of two, at least 16 (tl.dot's minimum)
    ROWS_PER_TILE: tl.constexpr,  # rows of the Q tile, a power of two >= group
    TOKENS_PER_TILE: tl.constexpr,  # ROWS_PER_TILE // group
    KEYS_PER_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32, ignored for bf16/fp16
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    first_token = tl.load(tiles_ptr + 2 * tile)
    seq = tl.load(tiles_ptr + 2 * tile + 1)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    tile_end = tl.minimum(first_token + TOKENS_PER_TILE, q_end)
    num_keys = seq_len - (q_end - tile_end)  # the tile's last row attends to keys 0..num_keys - 1

    r = tl.arange(0, ROWS_PER_TILE)  # [ROWS_PER_TILE] row r: token r // group, head r % group
    tokens = first_token + r // group  # [ROWS_PER_TILE]
    heads = kv_head * group + r % group  # [ROWS_PER_TILE]
    row_mask = (r < TOKENS_PER_TILE * group) & (tokens < q_end)  # [ROWS_PER_TILE]
    # Padding rows attend to key 0 only, so every row has a live key in the first key tile and the running
    # max is finite from then on; they are never stored.
    positions = tl.where(row_mask, seq_len - (q_end - tokens), 0)  # [ROWS_PER_TILE]
    d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    d_mask = d < head_dim  # [HEAD_DIM_PAD]
    n = tl.arange(0, KEYS_PER_TILE)  # [KEYS_PER_TILE]

    q_offs = tokens.to(tl.int64)[:, None] * stride_q_token + heads[:, None] * stride_q_head + d[None, :]
    rd_mask = row_mask[:, None] & d_mask[None, :]  # [ROWS_PER_TILE, HEAD_DIM_PAD]
    q = tl.load(q_ptr + q_offs, mask=rd_mask, other=0.0)  # [ROWS_PER_TILE, HEAD_DIM_PAD]

    m = tl.full([ROWS_PER_TILE], float("-inf"), tl.float32)  # [ROWS_PER_TILE] running max (log2 units)
    denom = tl.zeros([ROWS_PER_TILE], tl.float32)  # [ROWS_PER_TILE] running sum of exp2
    acc = tl.zeros([ROWS_PER_TILE, HEAD_DIM_PAD], tl.float32)  # [ROWS_PER_TILE, HEAD_DIM_PAD]

    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for start in range(0, num_keys, KEYS_PER_TILE):
        keys = start + n  # [KEYS_PER_TILE] positions in the sequence
        key_mask = keys < num_keys  # [KEYS_PER_TILE]
        k_t, v = load_kv_tile(
            kv_ptr,
            block_table,
            keys,
            key_mask,
            kv_head,
            d,
            d_mask,
            stride_kv_page,
            stride_kv_kind,
            stride_kv_slot,
            stride_kv_head,
            stride_bt_block,
            block_size,
        )  # [HEAD_DIM_PAD, KEYS_PER_TILE] (K transposed), [KEYS_PER_TILE, HEAD_DIM_PAD]

        causal = keys[None, :] <= positions[:, None]  # [ROWS_PER_TILE, KEYS_PER_TILE], implies key_mask
        m, denom, acc = attend_kv_tile(
            q, k_t, v, causal, m, denom, acc, scale_log2, DOT_PRECISION
        )  # [ROWS_PER_TILE], [ROWS_PER_TILE], [ROWS_PER_TILE, HEAD_DIM_PAD]

    out = acc / denom[:, None]  # [ROWS_PER_TILE, HEAD_DIM_PAD]
    out_offs = tokens.to(tl.int64)[:, None] * stride_out_token + heads[:, None] * stride_out_head + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=rd_mask)


def tile_rows(group: int) -> int:
    """Rows of the Q tile for a group of query heads per kv head: _ROWS_PER_TILE, or wider for a wider group."""
    return max(_ROWS_PER_TILE, triton.next_power_of_2(group))


def tokens_per_tile(group: int) -> int:
    """Query tokens one program covers: as many as fit the Q tile with their whole group of heads."""
    return tile_rows(group) // group


@functools.cache  # a pure function of its arguments: built once per model shape and dtype, not per layer
def prefill_launch(dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> TritonLaunch:
    """The kernel's constexprs, ``num_warps`` and signature, as ``paged_prefill_attention_triton`` launches it."""
    t = triton_type(dtype)
    arg_types = {
        **dict.fromkeys(("q_ptr", "kv_ptr", "out_ptr"), f"*{t}"),
        **dict.fromkeys(("query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "tiles_ptr"), "*i32"),
        "scale_log2": "fp32",
        **dict.fromkeys(ATTENTION_STRIDE_ARGS, "i32"),
    }
    constexprs = {
        "group": group,
        "head_dim": head_dim,
        "block_size": block_size,
        "HEAD_DIM_PAD": max(16, triton.next_power_of_2(head_dim)),
        "ROWS_PER_TILE": tile_rows(group),
        "TOKENS_PER_TILE": tokens_per_tile(group),
        "KEYS_PER_TILE": _KEYS_PER_TILE,
        "DOT_PRECISION": dot_precision(dtype),
    }
    return make_launch(_paged_prefill_attention_kernel, dtype, arg_types, constexprs, _NUM_WARPS)


def triton_launches() -> tuple[TritonLaunch, ...]:
    """The kernel at SmolLM2-135M's shape (``AOT_ATTENTION_SHAPE``) in every dtype the launcher accepts."""
    shape = AOT_ATTENTION_SHAPE
    return tuple(prefill_launch(dtype, shape.group, shape.head_dim, shape.block_size) for dtype in _SUPPORTED_DTYPES)


def plan_prefill_tiles(query_start_loc: tuple[int, ...], group: int, device: torch.device) -> torch.Tensor:
    """The tiles of every segment of at least MIN_TILED_ROWS rows, from the host's query_start_loc.

    Returns [num_tiles, 2] int32 on ``device``: (first query row, sequence) per tile. Built on the host and
    copied once (pinned and asynchronous on CUDA), so no device value is read back. A segment's last tiles
    read the most keys, so each segment's tiles are listed last first: the longest programs start first.
    """
    step = tokens_per_tile(group)
    tiles: list[int] = []
    for seq, (start, end) in enumerate(itertools.pairwise(query_start_loc)):
        if end - start >= MIN_TILED_ROWS:
            for first in reversed(range(start, end, step)):
                tiles.extend((first, seq))
    host = torch.tensor(tiles, dtype=torch.int32).view(-1, 2)  # [num_tiles, 2]
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)  # [num_tiles, 2]
    return host.to(device)  # [num_tiles, 2]


def paged_prefill_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor,
    tiles: torch.Tensor,
) -> None:
    """Write into ``out`` the attention of every query row of a segment of at least MIN_TILED_ROWS rows.

    The arguments are ``paged_attention_triton``'s, which checks them (call that; this is its tiled half);
    ``out`` is [num_tokens, num_heads, head_dim] like ``q``, contiguous; rows of shorter segments are left
    untouched. ``tiles`` is ``plan_prefill_tiles(meta.query_start_loc_list, group, q.device)``.
    """
    num_tiles = tiles.shape[0]
    if num_tiles == 0:
        return
    _, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    launch = prefill_launch(q.dtype, num_heads // num_kv_heads, head_dim, block_size)
    # One program per (tile of query rows, kv head): the tile stacks the kv head's whole group of query
    # heads, so each K/V tile is loaded once for the group and feeds two tensor-core products.
    grid = (num_tiles, num_kv_heads)
    _paged_prefill_attention_kernel[grid](
        q,
        kv_cache,
        out,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        tiles,
        scale * _LOG2_E,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        meta.block_tables.stride(1),
        **launch.constexprs,
        **launch.options(),
    )
