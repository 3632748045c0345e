"""The Triton launcher of paged attention, and its row kernel: decode rows and short chunks on tensor cores.

``paged_attention_triton`` splits the step's rows: segments of MIN_TILED_ROWS rows or more take the tiled kernel
(``loraplex_kernels.attention.paged_prefill_attention``), the others the row kernel here, one program per
(query row, kv head, chunk of keys).

The row kernel attends to a long context in chunks of ``keys_per_split`` keys (KEYS_PER_SPLIT), one
program per chunk, and the combine kernel of ``loraplex_kernels.attention.paged_attention_split`` joins them; a row
of ``keys_per_split`` keys or fewer is one program that writes its output directly. The number of chunks of
a row and their boundaries depend only on the row's own position (its context length), never on how many
rows the step holds or how long they are, and the chunks are combined in order: a row the row kernel takes
is the same bits whatever other rows share the step.
"""

import functools
import itertools
import math

import torch
import triton
import triton.language as tl

from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata
from loraplex_kernels.attention.kv_tile import attend_kv_tile, load_kv_tile
from loraplex_kernels.attention.paged_attention_split import (
    BATCH_STRIDE_ARGS,
    KEYS_PER_SPLIT,
    SPLIT_STRIDE_ARGS,
    SplitScratch,
    combine_splits,
    max_row_splits,
)
from loraplex_kernels.attention.paged_prefill_attention import (
    MIN_TILED_ROWS,
    paged_prefill_attention_triton,
    plan_prefill_tiles,
)
from loraplex_kernels.triton_launch import (
    AOT_ATTENTION_SHAPE,
    ATTENTION_STRIDE_ARGS,
    TritonLaunch,
    dot_precision,
    make_launch,
    triton_type,
)

# Keys scored per loop iteration. A tile may span several pages (each key finds its own page), so it is
# independent of block_size. Both products are tl.dot (on tensor cores in 16-bit dtypes): the kv head's group of
# query heads is the Q tile's rows, padded to 16 (mma's M), so a K/V tile is read once for the whole group.
_KEYS_PER_TILE = 32
_MIN_DOT_ROWS = 16
_NUM_WARPS = 4
# The kernel exponentiates with exp2, so the softmax scale is carried in log2 units.
_LOG2_E = math.log2(math.e)

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# The block table's row stride is its width, the step's most pages: generic like the scratch's (see
# BATCH_STRIDE_ARGS), so one compiled kernel serves every batch. Its column stride is 1 in an eager step (a
# specialised constant) and the graph's row count in a CUDA graph's step (engine/step/decode_graphs.py).
@triton.jit(do_not_specialize=("stride_bt_seq", *BATCH_STRIDE_ARGS))
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    kv_ptr,  # [num_pages, 2, block_size, num_kv_heads, head_dim], strided
    out_ptr,  # [num_tokens, num_heads, head_dim]
    split_max_ptr,  # [num_tokens, max_splits, num_heads] fp32, heads contiguous; written for rows of several chunks
    split_sum_ptr,  # [num_tokens, max_splits, num_heads] fp32, strided as split_max
    split_acc_ptr,  # [num_tokens, max_splits, num_heads, head_dim] fp32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32, strided
    token_to_seq_ptr,  # [num_tokens] int32
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
    stride_split_token,
    stride_split_split,
    stride_acc_token,
    stride_acc_split,
    stride_acc_head,
    min_tiled_rows,  # rows of segments at least this long are the tiled kernel's: their programs exit at once
    group: tl.constexpr,  # query heads per kv head
    head_dim: tl.constexpr,
    block_size: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # group rounded up to a power of two, at least 16 (tl.dot's rows)
    HEAD_DIM_PAD: tl.constexpr,  # head_dim rounded up to a power of two, at least 16 (tl.dot's minimum)
    KEYS_PER_TILE: tl.constexpr,
    KEYS_PER_SPLIT: tl.constexpr,  # keys per chunk, a multiple of KEYS_PER_TILE
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32, ignored for bf16/fp16
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = tl.load(token_to_seq_ptr + token)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    position = seq_len - (q_end - token)  # this row attends to keys 0..position
    key_start = split * KEYS_PER_SPLIT  # this program's chunk: keys key_start..key_end - 1
    # Programs of chunks past the row's position (the grid is sized for the step's longest row) exit at once.
    if (q_end - q_start < min_tiled_rows) & (key_start <= position):
        key_end = tl.minimum(position + 1, key_start + KEYS_PER_SPLIT)

        g = tl.arange(0, GROUP_PAD)  # [GROUP_PAD]
        d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
        n = tl.arange(0, KEYS_PER_TILE)  # [KEYS_PER_TILE]
        g_mask = g < group  # [GROUP_PAD]
        d_mask = d < head_dim  # [HEAD_DIM_PAD]
        heads = kv_head * group + g  # [GROUP_PAD]

        head_offs = heads[:, None] * stride_q_head + d[None, :]  # [GROUP_PAD, HEAD_DIM_PAD]
        gd_mask = g_mask[:, None] & d_mask[None, :]  # [GROUP_PAD, HEAD_DIM_PAD]
        q_row = q_ptr + token.to(tl.int64) * stride_q_token
        # Padding rows are zeros: their scores are 0, so their running max stays finite; they are never stored.
        q = tl.load(q_row + head_offs, mask=gd_mask, other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # [GROUP_PAD] running max (log2 units)
        denom = tl.zeros([GROUP_PAD], tl.float32)  # [GROUP_PAD] running sum of exp2
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)  # [GROUP_PAD, HEAD_DIM_PAD]

        block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
        # Every tile starts at a key < key_end, so each has at least one live key and m stays finite.
        for start in range(key_start, key_end, KEYS_PER_TILE):
            keys = start + n  # [KEYS_PER_TILE] positions in the sequence
            key_mask = keys < key_end  # [KEYS_PER_TILE]
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

            m, denom, acc = attend_kv_tile(
                q, k_t, v, key_mask[None, :], m, denom, acc, scale_log2, DOT_PRECISION
            )  # [GROUP_PAD], [GROUP_PAD], [GROUP_PAD, HEAD_DIM_PAD]

        if position < KEYS_PER_SPLIT:  # the row is one chunk: its output, normalised here
            out = acc / denom[:, None]  # [GROUP_PAD, HEAD_DIM_PAD]
            out_offs = heads[:, None] * stride_out_head + d[None, :]  # [GROUP_PAD, HEAD_DIM_PAD]
            out_row = out_ptr + token.to(tl.int64) * stride_out_token
            tl.store(out_row + out_offs, out.to(out_ptr.dtype.element_ty), mask=gd_mask)
        else:  # one chunk of several: its statistics and accumulator, for the combine kernel
            stats_offs = token.to(tl.int64) * stride_split_token + split * stride_split_split + heads  # [GROUP_PAD]
            tl.store(split_max_ptr + stats_offs, m, mask=g_mask)
            tl.store(split_sum_ptr + stats_offs, denom, mask=g_mask)
            acc_offs = heads[:, None] * stride_acc_head + d[None, :]  # [GROUP_PAD, HEAD_DIM_PAD]
            acc_row = split_acc_ptr + token.to(tl.int64) * stride_acc_token + split * stride_acc_split
            tl.store(acc_row + acc_offs, acc, mask=gd_mask)


@functools.cache  # a pure function of its arguments: built once per model shape and dtype, not per layer
def row_launch(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int, keys_per_split: int = KEYS_PER_SPLIT
) -> TritonLaunch:
    """The row kernel's constexprs, ``num_warps`` and signature, as ``paged_attention_triton`` launches it."""
    t = triton_type(dtype)
    arg_types = {
        **dict.fromkeys(("q_ptr", "kv_ptr", "out_ptr"), f"*{t}"),
        **dict.fromkeys(("split_max_ptr", "split_sum_ptr", "split_acc_ptr"), "*fp32"),
        **dict.fromkeys(("query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "token_to_seq_ptr"), "*i32"),
        "scale_log2": "fp32",
        **dict.fromkeys((*ATTENTION_STRIDE_ARGS, *SPLIT_STRIDE_ARGS, "min_tiled_rows"), "i32"),
    }
    constexprs = {
        "group": group,
        "head_dim": head_dim,
        "block_size": block_size,
        "GROUP_PAD": max(_MIN_DOT_ROWS, triton.next_power_of_2(group)),
        "HEAD_DIM_PAD": max(_MIN_DOT_ROWS, triton.next_power_of_2(head_dim)),
        "KEYS_PER_TILE": _KEYS_PER_TILE,
        "KEYS_PER_SPLIT": keys_per_split,
        "DOT_PRECISION": dot_precision(dtype),
    }
    return make_launch(_paged_attention_kernel, dtype, arg_types, constexprs, _NUM_WARPS)


def triton_launches() -> tuple[TritonLaunch, ...]:
    """The row kernel at SmolLM2-135M's shape (``AOT_ATTENTION_SHAPE``) in every dtype the launcher accepts."""
    shape = AOT_ATTENTION_SHAPE
    return tuple(row_launch(dtype, shape.group, shape.head_dim, shape.block_size) for dtype in _SUPPORTED_DTYPES)


def paged_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    keys_per_split: int = KEYS_PER_SPLIT,
) -> torch.Tensor:
    """Launch the Triton kernels; see ``paged_attention`` for the semantics and the arguments.

    Segments of MIN_TILED_ROWS query rows or more (prefill chunks) take the tiled kernel, the others
    (decode rows, short chunks) the row kernel. The split reads only the host's ``query_start_loc_list``:
    the tiled kernel gets a tile list built on the host (``meta.prefill_tiles``, once per step, else here),
    the row kernel runs over every
    row and its programs for rows of long segments exit at once, so nothing is read back from the device.

    The row kernel attends to a row of more than ``keys_per_split`` keys (a positive multiple of 32, the
    row kernel's key tile) in chunks of that many keys, combined by a second kernel. The chunk axis of its
    grid is sized from the host's ``seq_lens_list``, for the step's longest row of a short segment.
    """
    _check_inputs(q, kv_cache, meta)
    if keys_per_split <= 0 or keys_per_split % _KEYS_PER_TILE:
        raise ValueError(f"keys_per_split must be a positive multiple of {_KEYS_PER_TILE}, got {keys_per_split}")
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads

    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0:
        return out
    segment_lens = [end - start for start, end in itertools.pairwise(meta.query_start_loc_list)]
    if max(segment_lens) >= MIN_TILED_ROWS:
        tiles = meta.prefill_tiles  # planned once per step by the engine; tests and other callers plan here
        if tiles is None:
            tiles = plan_prefill_tiles(meta.query_start_loc_list, group, q.device)  # [num_tiles, 2]
        paged_prefill_attention_triton(q, kv_cache, meta, scale, out, tiles)
    if min(segment_lens) >= MIN_TILED_ROWS:
        return out

    # One program per (query row, kv head, chunk of keys_per_split keys): the program loads that kv head's
    # whole group of query heads, so each K/V tile is read once for the group, rows of different sequences
    # and positions (decode or short chunks) need no padding to a common query length, and a few rows of
    # long contexts still make enough programs to fill the GPU.
    launch = row_launch(q.dtype, group, head_dim, block_size, keys_per_split)
    max_splits = max_row_splits(meta, keys_per_split)
    scratch = SplitScratch.allocate(num_tokens, max_splits, num_heads, head_dim, q.device)
    grid = (num_tokens, num_kv_heads, max_splits)
    _paged_attention_kernel[grid](
        q,
        kv_cache,
        out,
        scratch.running_max,
        scratch.exp_sum,
        scratch.acc,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.token_to_seq,
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
        *scratch.strides(),
        MIN_TILED_ROWS,
        **launch.constexprs,
        **launch.options(),
    )
    if max_splits > 1:
        combine_splits(out, scratch, meta, num_kv_heads, keys_per_split)
    return out


def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, meta: PagedAttentionMetadata) -> None:
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must match q dtype {q.dtype}")
    if q.dim() != 3 or not q.is_contiguous():
        raise ValueError(f"q must be a contiguous [num_tokens, num_heads, head_dim] tensor, got {q.shape}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [num_pages, 2, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache must be contiguous along head_dim (a layer view of the page pool is)")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[4]} != q head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if kv_cache.device != q.device:
        raise ValueError(f"kv_cache is on {kv_cache.device} but q is on {q.device}")
    num_seqs = meta.num_seqs
    expected = {
        "query_start_loc": (meta.query_start_loc, (num_seqs + 1,)),
        "seq_lens": (meta.seq_lens, (num_seqs,)),
        "token_to_seq": (meta.token_to_seq, (num_tokens,)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"meta.{name} must have shape {shape}, got {tuple(tensor.shape)}")
    for name in ("query_start_loc", "seq_lens", "token_to_seq"):
        tensor = getattr(meta, name)
        if tensor.dtype != torch.int32 or not tensor.is_contiguous() or tensor.device != q.device:
            raise ValueError(f"meta.{name} must be a contiguous int32 tensor on {q.device}")
    if meta.block_tables.dtype != torch.int32 or meta.block_tables.device != q.device:
        raise ValueError(f"meta.block_tables must be an int32 tensor on {q.device}")
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"meta.block_tables must be [num_seqs={num_seqs}, max_num_blocks], got {tuple(meta.block_tables.shape)}"
        )
    if meta.num_tokens != num_tokens:
        raise ValueError(f"meta covers {meta.num_tokens} query rows but q has {num_tokens}")
