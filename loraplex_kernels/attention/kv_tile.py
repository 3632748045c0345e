"""A tile of one kv head's keys and values, read through a sequence's block table: what both paged attention
kernels' key loops read.

A ``@triton.jit`` device function, called from the kernels and inlined into them; it is listed in
``DEVICE_FUNCTIONS``, so the ahead-of-time compile's walk does not take it for a kernel of its own.
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


DEVICE_FUNCTIONS = (load_kv_tile,)
