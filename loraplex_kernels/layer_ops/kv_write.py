"""Write this step's keys and values into their pages (a scatter; torch on every device)."""

import torch


def kv_row_index(slot_mapping: torch.Tensor, num_layers: int, block_size: int) -> torch.Tensor:
    """Row of each token's K at layer 0, counting rows of ``num_kv_heads * head_dim`` in the whole pool.

    The pool is ``[num_pages, num_layers, 2, block_size, kv_heads * head_dim]`` in rows, so K of slot
    (page, offset) at layer ``l`` is row ``(page * num_layers + l) * 2 * block_size + offset`` and V is
    ``block_size`` rows further. Computed once per step; layer ``l`` adds ``l * 2 * block_size``.
    """
    pages = slot_mapping // block_size  # [num_tokens]
    offsets = slot_mapping % block_size  # [num_tokens]
    return pages * (num_layers * 2 * block_size) + offsets  # [num_tokens]


def write_kv(
    storage: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    row_index: torch.Tensor,
) -> None:
    """Scatter each token's K/V row into its slot of layer ``layer``.

    Semantics:
        page, offset = slot_mapping[t] // block_size, slot_mapping[t] % block_size
        storage[page, layer] viewed as [2, block_size, kv_heads, head_dim]:
            [0, offset] = k[t];  [1, offset] = v[t]

    Args:
        storage: the page pool [num_pages, num_layers, P] with P = block_size * 2 * kv_heads * head_dim.
        layer: the layer whose K/V are written.
        k, v: [num_tokens, num_kv_heads, head_dim]; rounded to the storage's dtype (to nearest even) when
            it is narrower (fp32 activations into a bf16 pool).
        row_index: [num_tokens] int64 from :func:`kv_row_index` for this step.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    block_size = storage.shape[2] // (2 * num_kv_heads * head_dim)
    rows = storage.view(-1, num_kv_heads * head_dim)  # [num_pages * num_layers * 2 * block_size, kv_heads * D]
    k_rows = row_index + layer * 2 * block_size  # [num_tokens]
    rows.index_copy_(0, k_rows, k.reshape(num_tokens, -1).to(rows.dtype))
    rows.index_copy_(0, k_rows + block_size, v.reshape(num_tokens, -1).to(rows.dtype))
