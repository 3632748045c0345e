"""Paged attention in plain torch: the implementation the engine runs on CPU.

Decode rows (one query per sequence) are batched in a few buckets of similar context length (the
plan is made once per step): each bucket's pages are gathered once per layer with ``index_select``
(the rows of a page are contiguous, so this runs near memory-copy speed) and attended in one
``scaled_dot_product_attention`` call with a length mask. Buckets keep the padding, which costs as much
as real keys, small. Prefill chunks, a few per step, go one sequence
at a time with a causal mask shifted by the cached context.
"""

import torch
import torch.nn.functional as F

from loraplex_kernels.attention.attention_metadata import DecodeBucket, PagedAttentionMetadata, plan_decode_buckets


def paged_attention_torch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Torch implementation of :func:`loraplex_kernels.attention.paged_attention.paged_attention` (same semantics)."""
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    buckets = meta.decode_buckets or plan_decode_buckets(
        meta.seq_lens_list, meta.block_tables, meta.num_decode_seqs, kv_cache.shape[2], q.dtype
    )
    for bucket in buckets:
        out[bucket.start : bucket.end] = _decode(q[bucket.start : bucket.end], kv_cache, bucket, scale)
    starts = meta.query_start_loc_list
    for seq in range(meta.num_decode_seqs, meta.num_seqs):
        start, end = starts[seq], starts[seq + 1]
        out[start:end] = _prefill(q[start:end], kv_cache, meta.block_tables[seq], meta.seq_lens_list[seq], scale)
    return out


def _gather(kv_cache: torch.Tensor, kv_index: int, page_ids: torch.Tensor) -> torch.Tensor:
    """K (kv_index 0) or V (1) of the given pages, as one contiguous tensor."""
    num_pages, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    rows = kv_cache[:, kv_index].reshape(num_pages, block_size * num_kv_heads * head_dim)  # view
    gathered = rows.index_select(0, page_ids.reshape(-1))  # [num_ids, block_size * kv_heads * head_dim]
    return gathered.view(*page_ids.shape[:-1], page_ids.shape[-1] * block_size, num_kv_heads, head_dim)


def _decode(
    q: torch.Tensor,  # [rows, num_heads, head_dim]
    kv_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
) -> torch.Tensor:
    rows, num_heads, head_dim = q.shape
    k = _gather(kv_cache, 0, bucket.block_tables).transpose(1, 2)  # [rows, kv_heads, keys, head_dim]
    v = _gather(kv_cache, 1, bucket.block_tables).transpose(1, 2)  # [rows, kv_heads, keys, head_dim]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [rows, num_heads, 1, head_dim]
        k,
        v,
        attn_mask=bucket.mask,  # [rows, 1, 1, keys]; an additive float mask runs faster than a boolean one
        scale=scale,
        enable_gqa=True,
    )  # [rows, num_heads, 1, head_dim]
    return out.view(rows, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,  # [query_len, num_heads, head_dim]
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_blocks]
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    query_len = q.shape[0]
    block_size = kv_cache.shape[2]
    page_ids = block_table[: -(-seq_len // block_size)].unsqueeze(0)  # [1, num_blocks]
    k = _gather(kv_cache, 0, page_ids)[:, :seq_len].transpose(1, 2)  # [1, kv_heads, seq_len, head_dim]
    v = _gather(kv_cache, 1, page_ids)[:, :seq_len].transpose(1, 2)  # [1, kv_heads, seq_len, head_dim]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)  # [query_len]
        key_pos = torch.arange(seq_len, device=q.device)  # [seq_len]
        visible = key_pos[None, :] <= query_pos[:, None]  # [query_len, seq_len]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [query_len, num_heads, head_dim]
