"""Write this step's keys and values into their pages (a scatter; torch on every device)."""

import torch


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each token's K/V row into its slot.

    Semantics:
        page, offset = slot_mapping[t] // block_size, slot_mapping[t] % block_size
        kv_cache[page, 0, offset] = k[t];  kv_cache[page, 1, offset] = v[t]

    Args:
        kv_cache: [num_pages, 2, block_size, num_kv_heads, head_dim], one layer's view of the pool.
        k, v: [num_tokens, num_kv_heads, head_dim], same dtype as kv_cache.
        slot_mapping: [num_tokens] int64, page * block_size + offset.
    """
    block_size = kv_cache.shape[2]
    pages = slot_mapping // block_size  # [num_tokens]
    offsets = slot_mapping % block_size  # [num_tokens]
    kv_cache[pages, 0, offsets] = k
    kv_cache[pages, 1, offsets] = v
