"""One step of both paged attention kernels' key loops: a tile of one kv head's keys and values read through a
sequence's block table, and the Q tile's online softmax over it.

``@triton.jit`` device functions, called from the kernels and inlined into them; they are listed in
``DEVICE_FUNCTIONS``, so the ahead-of-time compile's walk does not take them for kernels of their own.
"""

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    kv_ptr,  # [num_pages, 2, block_size, num_kv_heads, head_dim], strided
    block_table,  # the sequence's row of the block table
    keys,  # [KEYS_PER_TILE] positions in the sequence
    key_mask,  # [KEYS_PER_TILE] the keys to read; the others load as zeros
    kv_head,
    d,  # [HEAD_DIM_PAD] 0..HEAD_DIM_PAD - 1
    d_mask,  # [HEAD_DIM_PAD] d < head_dim
    stride_kv_page,
    stride_kv_kind,
    stride_kv_slot,
    stride_kv_head,
    stride_bt_block,
    block_size: tl.constexpr,
):
    """K transposed, [HEAD_DIM_PAD, KEYS_PER_TILE], and V, [KEYS_PER_TILE, HEAD_DIM_PAD], of ``keys``: each key
    finds its own page, so a tile may span several."""
    pages = tl.load(block_table + (keys // block_size) * stride_bt_block, mask=key_mask, other=0)  # [KEYS_PER_TILE]
    key_offs = (
        pages.to(tl.int64) * stride_kv_page + (keys % block_size) * stride_kv_slot + kv_head * stride_kv_head
    )  # [KEYS_PER_TILE]
    k_t = tl.load(
        kv_ptr + key_offs[None, :] + d[:, None], mask=d_mask[:, None] & key_mask[None, :], other=0.0
    )  # [HEAD_DIM_PAD, KEYS_PER_TILE]
    v = tl.load(
        kv_ptr + stride_kv_kind + key_offs[:, None] + d[None, :], mask=key_mask[:, None] & d_mask[None, :], other=0.0
    )  # [KEYS_PER_TILE, HEAD_DIM_PAD]
    return k_t, v


@triton.jit
def attend_kv_tile(
    q,  # [ROWS, HEAD_DIM_PAD] the Q tile
    k_t,  # [HEAD_DIM_PAD, KEYS_PER_TILE]
    v,  # [KEYS_PER_TILE, HEAD_DIM_PAD]
    visible,  # [ROWS, KEYS_PER_TILE] or broadcast to it: the keys each row attends to
    m,  # [ROWS] running max of the scores, log2 units
    denom,  # [ROWS] running sum of exp2
    acc,  # [ROWS, HEAD_DIM_PAD] fp32, unnormalised
    scale_log2,  # softmax scale × log2(e)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32, ignored for bf16/fp16
):
    """The online softmax taken one tile further: ``(m, denom, acc)`` with the tile's visible keys added. Both
    products are ``tl.dot``; P is rounded to V's dtype before P·V. Every row must see a key by its first tile."""
    scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2  # [ROWS, KEYS_PER_TILE]
    scores = tl.where(visible, scores, float("-inf"))  # [ROWS, KEYS_PER_TILE]
    m_new = tl.maximum(m, tl.max(scores, axis=1))  # [ROWS]
    alpha = tl.exp2(m - m_new)  # [ROWS]
    p = tl.exp2(scores - m_new[:, None])  # [ROWS, KEYS_PER_TILE]
    denom = denom * alpha + tl.sum(p, axis=1)  # [ROWS]
    acc = acc * alpha[:, None]  # [ROWS, HEAD_DIM_PAD]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # [ROWS, HEAD_DIM_PAD]
    return m_new, denom, acc


DEVICE_FUNCTIONS = (load_kv_tile, attend_kv_tile)
