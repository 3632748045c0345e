"""SGMV shrink and expand in plain torch: the implementations the engine runs on CPU.

A plan, built once per step and module group, turns the segments into a handful of calls per layer,
however many adapters the step has. The plan holds only index tensors into the pool's layer-0 slice;
each call adds the layer's offset by viewing the pool from ``layer_offset`` on, so one plan serves
every layer (the plan is built in :mod:`loraplex_kernels.sgmv.sgmv_torch_plan`). Rows are addressed in pieces of
``chunk`` elements (the gcd of P, the row lengths and the row addresses: 192 for SmolLM2 laid out as
the engine does), so gathering them copies whole pieces.

Shrink (``v = x @ Aᵀ`` per segment) is a batched matrix product. The tokens reading the same A rows
(all modules' rows stacked; one adapter, wherever its tokens sit in the step) are an item; items of
equal total rank form a batch, tokens padded to the batch's most (a call costs more than the padding's
multiply-adds: with 16 adapters in a decode step, batching by rank and power-of-two length made 9 batches
a layer where by rank alone it makes 3, and took longer); per layer a
batch costs an ``index_select`` of its adapters' A rows (the layer's rows of all the step's adapters, a
few MB, still in cache when read), one of x, a ``bmm`` and an ``index_copy_`` into v.
An item of many tokens (a prefill chunk) is a batch of its own.

Expand (``y += v @ Bᵀ`` per segment) of the short segments is one ``embedding_bag`` call: a bag per
(token, module, piece of output columns) sums that module's Bᵀ row pieces weighted by the token's v,
reading the rows straight from the pool with no gathered copy, then an ``index_add_`` into y. Long
segments' expand is a ``bmm`` per (rank, output width), where a matrix product beats row sums.

The shrink is bound by reading the adapters' A rows (8.6 MB a layer for 64 adapters) out of the pool.
A gather of every layer's rows once per step, then a ``bmm`` per layer, was slower: it copies all the
adapters' weights (400 MB for 64 adapters) through memory every step. The expand's bags were faster than
a gather + ``bmm`` + add, and planning once per step rather than on every call is what keeps a layer
cheap. The figures, and the command that measures them: docs/benchmarks.md#sgmv-on-cpu-bench_sgmv_cpupy.
"""

from typing import Protocol

import torch
import torch.nn.functional as F

from loraplex_kernels.sgmv.lora_metadata import SgmvMetadata
from loraplex_kernels.sgmv.sgmv_torch_plan import SgmvTorchPlan, plan_sgmv_torch


def sgmv_shrink_torch(
    x: torch.Tensor,
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    plan: SgmvTorchPlan | None = None,
) -> torch.Tensor:
    """Torch implementation of :func:`loraplex_kernels.sgmv.sgmv_shrink.sgmv_shrink` (same semantics)."""
    if plan is None:
        plan = plan_sgmv_torch(storage, meta)
    rows = layer_pieces(storage, meta, plan, layer_offset, plan.chunk)  # [pieces, chunk]
    v = x.new_zeros(meta.num_tokens + 1, meta.v_width)  # [num_tokens + 1, v_width], last row: padding's dump
    v_flat = v.view(-1)  # [(num_tokens + 1) * v_width]
    for batch in plan.shrink:
        n, r, pad_len = batch.num_items, batch.rank, batch.pad_len
        a = rows.index_select(0, batch.weight_chunks).view(n, r, meta.in_dim)  # [n, r, in_dim]
        xs = x.index_select(0, batch.token_rows).view(n, pad_len, meta.in_dim)  # [n, pad_len, in_dim]
        out = torch.bmm(xs, a.transpose(1, 2))  # [n, pad_len, r]
        v_flat.index_copy_(0, batch.v_index, out.view(-1))
    return v[: meta.num_tokens]  # [num_tokens, v_width]


def sgmv_expand_torch(
    v: torch.Tensor,
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    y: torch.Tensor,
    plan: SgmvTorchPlan | None = None,
) -> None:
    """Torch implementation of :func:`loraplex_kernels.sgmv.sgmv_expand.sgmv_expand` (same semantics)."""
    if plan is None:
        plan = plan_sgmv_torch(storage, meta)
    v_flat = v.reshape(-1)  # [num_tokens * v_width]
    if plan.bags is not None:
        bags = plan.bags
        table = layer_pieces(storage, meta, plan, layer_offset, plan.bag_chunk)  # [pieces, bag_chunk]
        weights = v_flat.index_select(0, bags.v_index)  # [num_indices]
        sums = F.embedding_bag(bags.indices, table, bags.offsets, mode="sum", per_sample_weights=weights)
        y.view(-1, plan.bag_chunk).index_add_(0, bags.y_chunks, sums)  # sums: [num_bags, bag_chunk]
    if plan.expand:
        rows = layer_pieces(storage, meta, plan, layer_offset, plan.chunk)  # [pieces, chunk]
        y_pieces = y.view(-1, plan.y_chunk)  # [num_tokens * y_width / y_chunk, y_chunk]
    for batch in plan.expand:
        n, r, num_tokens, out_dim = batch.num_items, batch.rank, batch.num_tokens, batch.out_dim
        b = rows.index_select(0, batch.weight_chunks).view(n, r, out_dim)  # [n, r, out_dim]
        vs = v_flat.index_select(0, batch.v_index).view(n, num_tokens, r)  # [n, num_tokens, r]
        out = torch.bmm(vs, b)  # [n, num_tokens, out_dim]
        y_pieces.index_add_(0, batch.y_chunks, out.view(-1, plan.y_chunk))


class LayerPlan(Protocol):
    """A CPU plan for one step's metadata, valid at every layer offset that is a multiple of its chunk."""

    @property
    def meta(self) -> SgmvMetadata: ...

    @property
    def chunk(self) -> int: ...


def layer_pieces(
    storage: torch.Tensor, meta: SgmvMetadata, plan: LayerPlan, layer_offset: int, piece: int
) -> torch.Tensor:
    """The pool from ``layer_offset`` on, cut into pieces of ``piece`` elements: a view."""
    if plan.meta is not meta:
        raise ValueError("the plan was built for another SgmvMetadata; plan each step's metadata")
    if layer_offset % plan.chunk or storage.numel() % plan.chunk:
        raise ValueError(f"layer_offset {layer_offset} is not a multiple of the plan's chunk {plan.chunk}")
    return storage.view(-1)[layer_offset:].view(-1, piece)  # [(numel - layer_offset) / piece, piece]
