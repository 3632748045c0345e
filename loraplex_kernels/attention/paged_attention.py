"""Paged attention for decode and chunked prefill, with grouped-query heads: the op every backend implements.

Every query row attends causally to its sequence's cached keys, read page by page through the
sequence's block table; a decode row and a prefill row are the same problem with different positions.
``paged_attention`` runs it on the engine's kernel backend: the Triton kernels
(``loraplex_kernels.attention.paged_attention_triton``), the native CPU op, or the torch implementation
(``loraplex_kernels.attention.paged_attention_torch``).
"""

import torch

from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata
from loraplex_kernels.attention.paged_attention_torch import paged_attention_torch
from loraplex_kernels.attention.paged_attention_triton import paged_attention_triton
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import require_native_ops


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    backend: KernelBackend = KernelBackend.TORCH,
) -> torch.Tensor:
    """Causal attention of each query row over its sequence's paged K/V, one call for the whole step.

    ``backend`` picks the implementation: TRITON the Triton kernel (compiled on CUDA, interpreted on CPU),
    NATIVE the C++ CPU op (one pass over the pages in place, every sequence's rows at once, each row
    computed as a decode row of its position: the same bits whatever else the call holds), TORCH the
    torch implementation (decode buckets and a call per prefill chunk; on any device).

    Args:
        q: [num_tokens, num_heads, head_dim], float32, bfloat16 or float16 (the native op: float32);
            rows packed sequence after sequence as ``meta.query_start_loc`` says. May be strided along
            tokens and heads (the q columns of the fused qkv output); head_dim must be contiguous.
        kv_cache: [num_pages, 2, block_size, num_kv_heads, head_dim], same dtype as ``q`` (the native op:
            float32 or bfloat16, widened to float32 as it is read); one layer's
            view of the page pool (pages strided, each page contiguous); index 0 of dim 1 is K, 1 is V.
            num_heads must be a multiple of num_kv_heads (group = num_heads // num_kv_heads).
        meta: the step's ``PagedAttentionMetadata``; its int32 tensors on ``q``'s device.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        backend: the implementation, the engine's resolved ``kernels`` setting.

    Returns:
        out: [num_tokens, num_heads, head_dim], same dtype as ``q``, contiguous.

    Semantics:
        for s in range(num_seqs):
            for i in range(query_start_loc[s], query_start_loc[s + 1]):
                pos = seq_lens[s] - (query_start_loc[s + 1] - i)
                pages, slots = block_tables[s, j // block_size], j % block_size  for j in 0..pos
                K = kv_cache[pages, 0, slots]                     # [pos + 1, num_kv_heads, head_dim]
                V = kv_cache[pages, 1, slots]                     # [pos + 1, num_kv_heads, head_dim]
                for h in range(num_heads):
                    kvh = h // group
                    p = softmax(scale * K[:, kvh] @ q[i, h])      # [pos + 1], in fp32
                    out[i, h] = p @ V[:, kvh]                     # [head_dim]
    """
    if backend is KernelBackend.TRITON:
        return paged_attention_triton(q.contiguous(), kv_cache, meta, scale)
    if backend is KernelBackend.NATIVE:
        return require_native_ops().paged_attention(
            q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale
        )  # [num_tokens, num_heads, head_dim]
    return paged_attention_torch(q.contiguous(), kv_cache, meta, scale)
