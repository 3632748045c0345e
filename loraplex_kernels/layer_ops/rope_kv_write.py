"""RoPE on the fused qkv output, in place, and the write of this step's K/V into their pages."""

import torch

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.layer_ops.kv_write import write_kv
from loraplex_kernels.native_cpu import require_native_ops


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for x [num_tokens, heads, head_dim] and tables [num_tokens, 1, head_dim].

    ``rotate_half(x) * sin`` equals ``x`` with its halves swapped times ``sin`` with its first half
    negated (the signed sin), so a rotation is a multiply, a roll and an ``addcmul``.
    """
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # [num_tokens, heads, head_dim], halves swapped
    return torch.addcmul(x * cos, swapped, signed_sin)  # [num_tokens, heads, head_dim]


def rope_kv_write_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    storage: torch.Tensor,
    layer: int,
    kv_rows: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Torch implementation of :func:`rope_kv_write` (same semantics)."""
    num_tokens, head_dim = cos.shape
    num_rotated = num_heads + num_kv_heads
    qk = qkv[:, : num_rotated * head_dim].view(num_tokens, num_rotated, head_dim)  # [tokens, heads + kv_heads, D]
    qk.copy_(rotate(qk, cos.unsqueeze(1), signed_sin.unsqueeze(1)))
    v = qkv[:, num_rotated * head_dim :].view(num_tokens, num_kv_heads, head_dim)  # [tokens, kv_heads, D]
    write_kv(storage, layer, qk[:, num_heads:], v, kv_rows)


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    storage: torch.Tensor,
    layer: int,
    kv_rows: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    backend: KernelBackend = KernelBackend.TORCH,
) -> None:
    """Rotate the q and k heads of ``qkv`` in place (Hugging Face's rotate-half RoPE), then write each
    token's rotated k and its v into its slot of layer ``layer`` of the pool.

    Args:
        qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], rows contiguous: q heads, k heads,
            v heads (the fused projection's output). q and k are rotated in place.
        cos, signed_sin: [num_tokens, head_dim], contiguous; each token's row of the tables
            (``cos = [cos, cos]``, ``signed_sin = [-sin, sin]`` at its position; engine/modeling/rope.py).
        storage: the page pool's K/V [num_pages, num_layers, P], P = block_size * 2 * num_kv_heads * head_dim,
            in qkv's dtype or bfloat16 (then k and v are rounded to nearest even as they are written).
        layer: the layer whose K/V are written.
        kv_rows: [num_tokens] int64 from :func:`loraplex_kernels.layer_ops.kv_write.kv_row_index` (each token's slot).
        num_heads, num_kv_heads: the heads in ``qkv``.
        backend: NATIVE runs the C++ op (float32 qkv, float32 or bfloat16 storage, CPU); TORCH and TRITON (no
            Triton kernel here) the torch ops.

    Semantics:
        half = head_dim // 2
        for t, h in tokens x (q and k heads):
            x = qkv[t, h]                                         # [head_dim]
            qkv[t, h] = x * cos[t] + roll(x, half) * signed_sin[t]
        k, v = qkv[t, k heads], qkv[t, v heads]                   # [num_kv_heads, head_dim] each
        storage rows (num_kv_heads * head_dim wide) at kv_rows[t] + layer * 2 * block_size: = k
                                           and block_size further: = v
    """
    if backend is KernelBackend.NATIVE:
        require_native_ops().rope_kv_write(qkv, cos, signed_sin, storage, layer, kv_rows, num_heads, num_kv_heads)
        return
    rope_kv_write_torch(qkv, cos, signed_sin, storage, layer, kv_rows, num_heads, num_kv_heads)
