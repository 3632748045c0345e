"""SGMV shrink and expand in plain torch: the implementations the engine runs on CPU.

A plan, built once per step and module group, turns the segments into a handful of calls per layer,
however many adapters the step has. The plan holds only index tensors into the pool's layer-0 slice;
each call adds the layer's offset by viewing the pool from ``layer_offset`` on, so one plan serves
every layer. Rows are addressed in pieces of ``chunk`` elements (the gcd of P, the row lengths and the
row addresses: 192 for SmolLM2 laid out as the engine does), so gathering them copies whole pieces.

Shrink (``v = x @ Aᵀ`` per segment) is a batched matrix product. The tokens reading the same A rows
(all modules' rows stacked; one adapter, wherever its tokens sit in the step) are an item; items of
equal total rank form a batch, tokens padded to the batch's most (a call costs more than the padding's
multiply-adds: with 16 adapters in a decode step, batching by rank and power-of-two length made 9 batches
a layer where by rank alone it makes 3, and a layer's q/k/v took 0.76 instead of 1.10 ms); per layer a
batch costs an ``index_select`` of its adapters' A rows (the layer's rows of all the step's adapters, a
few MB, still in cache when read), one of x, a ``bmm`` and an ``index_copy_`` into v.
An item of many tokens (a prefill chunk) is a batch of its own.

Expand (``y += v @ Bᵀ`` per segment) of the short segments is one ``embedding_bag`` call: a bag per
(token, module, piece of output columns) sums that module's Bᵀ row pieces weighted by the token's v,
reading the rows straight from the pool with no gathered copy, then an ``index_add_`` into y. Long
segments' expand is a ``bmm`` per (rank, output width), where a matrix product beats row sums.

Measured with ``scripts/bench_sgmv_cpu.py --threads 1`` (AMD EPYC Genoa VM, fp32, torch 2.13, medians;
the host was shared, so figures moved by up to ±30% between runs). SmolLM2's q/k/v group (in 576, outs
576/192/192, 30 layers, P = 6144), a decode batch of 64 tokens, ranks drawn from 8/16/32:

    adapters (segments)    per step: metadata + plan   per layer: shrink  expand  both   base x @ W.T
    16 (16, by adapter)    0.25 + 0.7 ms                          0.5     0.2     0.65   0.75 ms
    16 (64, random order)  0.55 + 0.8 ms                          0.7     0.2     0.95   0.75 ms
    64 (64)                0.85 + 0.7 ms                          1.6     0.6     2.3    0.75 ms

Re-run after batching the shrink by rank alone, alternating with the code before it on a noisier day:
"both" 0.90-0.91 / 0.83-0.88 / 3.2-3.4 ms for the three rows against 0.98-1.00 / 0.68-1.13 / 2.4-3.4
(this synthetic batch gives each of 64 adapters one token, so both plans are the same there; with the
engine's real decode steps the change is measured in the shrink's docstring above).
The base is the 576 -> 960 projection as F.linear (0.65 to 0.7 ms oneDNN-packed, as the engine runs it).
With 2 threads the 16-adapter layer took 0.55 to 1.0 ms (base 0.5, packed 0.4); the 2-thread runs with
64 adapters were distorted by the shared host (ops over ~1 MB stalled on OpenMP barriers while another
process held a core) and are not quoted. Without a plan (planned on every call) a layer took 2 to 6 ms.
The shrink is bound by reading the adapters' A rows (8.6 MB a layer for 64 adapters) out of the pool.
A gather of every layer's rows once per step, then a ``bmm`` per layer, was slower: for 64 adapters the
gather alone took 450 ms a step (it copies all the adapters' weights, 400 MB, through memory), against
30 x 2.3 ms here. The expand's bags took 0.2 to 0.6 ms a layer where a gather + ``bmm`` + add took 0.8
to 1.2 ms.
"""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from kernels.lora_metadata import SgmvMetadata

# Segments of up to this many tokens are short: shrink batches the items they make by rank, their token
# counts padded to the batch's most (at most this many), and expand sums rows per token. A longer
# segment (a prefill chunk) gets matrix products of its own, which beat per-token row sums there.
MAX_SHORT_LEN = 16


@dataclass(frozen=True, slots=True)
class ShrinkBatch:
    """Items (the tokens reading the same A rows, all modules' rows stacked) of equal total rank ``rank``,
    their tokens padded to ``pad_len``: one ``bmm``."""

    num_items: int
    rank: int
    pad_len: int
    weight_chunks: torch.Tensor  # [num_items * rank * in_dim / chunk] int64, pieces of A rows at layer 0
    token_rows: torch.Tensor  # [num_items * pad_len] int64, rows of x (padding repeats a real row)
    v_index: torch.Tensor  # [num_items * pad_len * rank] int64, into v padded with a dump row: [T + 1, v_width]


@dataclass(frozen=True, slots=True)
class ExpandBatch:
    """One long segment's modules of equal rank and output width ``out_dim``: one ``bmm``."""

    num_items: int
    rank: int
    out_dim: int
    num_tokens: int
    weight_chunks: torch.Tensor  # [num_items * rank * out_dim / chunk] int64, pieces of Bᵀ rows at layer 0
    v_index: torch.Tensor  # [num_items * num_tokens * rank] int64, flat index into v
    y_chunks: torch.Tensor  # [num_items * num_tokens * out_dim / y_chunk] int64, pieces of y.view(-1, y_chunk)


@dataclass(frozen=True, slots=True)
class ExpandBags:
    """The short segments' expand as one ``embedding_bag``: a bag per (token, module, piece of
    ``bag_chunk`` output columns) holds that module's ``rank`` Bᵀ row pieces, weighted by v."""

    indices: torch.Tensor  # [num_indices] int64, pieces of Bᵀ rows at layer 0, in units of bag_chunk
    offsets: torch.Tensor  # [num_bags] int64, each bag's first index
    v_index: torch.Tensor  # [num_indices] int64, flat index into v of each index's weight
    y_chunks: torch.Tensor  # [num_bags] int64, each bag's piece of y.view(-1, bag_chunk)


@dataclass(frozen=True, slots=True)
class SgmvTorchPlan:
    """The CPU implementation's calls for one step and module group; valid for every layer."""

    meta: SgmvMetadata = field(repr=False)  # the metadata planned for; the ops refuse any other
    chunk: int  # elements per gathered piece of a row: divides P, every row length and row address
    y_chunk: int  # elements per added piece of y: divides y's width and every module's offset and width
    bag_chunk: int  # elements per bag: divides both of the above
    shrink: tuple[ShrinkBatch, ...]
    expand: tuple[ExpandBatch, ...]
    bags: ExpandBags | None


def plan_sgmv_torch(storage: torch.Tensor, meta: SgmvMetadata) -> SgmvTorchPlan:
    """Plan the CPU implementation's calls for ``meta``, once per step (layer independent).

    ``storage`` ([num_pages, num_layers, P]) gives the page size P and the device; its contents are
    not read.
    """
    rows = _PairRows(meta)
    chunk = rows.chunk(storage.shape[-1])
    y_chunk = math.gcd(meta.y_width, *meta.out_dims, *meta.out_offsets)
    bag_chunk = math.gcd(chunk, y_chunk)

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64).reshape(-1)).to(storage.device)

    starts = meta.seg_starts_list
    lengths = [starts[s + 1] - starts[s] for s in range(meta.num_segments)]
    # Shrink: every module of a segment reads the same x rows, so its modules' A rows are stacked; and
    # segments reading the same rows (one adapter, wherever its tokens sit in the step) are one item, so
    # each adapter's rows are gathered once per layer however the tokens are ordered.
    item_of_signature: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    item_of_segment = np.full(meta.num_segments, -1)  # [num_segments]
    for seg, length in enumerate(lengths):
        if sum(meta.ranks_list[seg]) and length:
            signature = (meta.row_start_a_list[seg], meta.ranks_list[seg])
            item_of_segment[seg] = item_of_signature.setdefault(signature, len(item_of_signature))
    tokens = _ItemTokens(rows.seg_starts, item_of_segment, len(item_of_signature))
    shrink_keys: dict[tuple[int, int], list[int]] = {}
    for item, seg in enumerate(tokens.first_segment):
        rank = sum(meta.ranks_list[seg])
        shrink_keys.setdefault((rank, -1 if tokens.count[item] <= MAX_SHORT_LEN else item), []).append(item)
    shrink = []
    for (rank, _), items in shrink_keys.items():
        pad_len = int(tokens.count[items].max())
        flat = rows.segment_first[tokens.first_segment[items]][:, None] + np.arange(rank)  # [num_items, rank]
        token_rows, token_segments, real = tokens.padded(np.array(items), pad_len)  # [num_items, pad_len] x 3
        out_rows = np.where(real, token_rows, meta.num_tokens)  # [num_items, pad_len], padding: the dump row
        cols = rows.cols[rows.segment_first[token_segments][:, :, None] + np.arange(rank)]  # [items, pad, rank]
        shrink.append(
            ShrinkBatch(
                num_items=len(items),
                rank=rank,
                pad_len=pad_len,
                weight_chunks=tensor(_chunks(rows.addr_a[flat], meta.in_dim, chunk)),
                token_rows=tensor(token_rows),
                v_index=tensor(out_rows[:, :, None] * meta.v_width + cols),
            )
        )

    # Expand: short segments' (segment, module) pairs go to the bags, grouped by (rank, pieces per row);
    # a long segment's pairs of equal (rank, out_dim) share a bmm.
    bag_keys: dict[tuple[int, int], list[int]] = {}
    long_keys: dict[tuple[int, int, int], list[int]] = {}
    for s, m in itertools.product(range(meta.num_segments), range(meta.num_modules)):
        rank = meta.ranks_list[s][m]
        if rank and lengths[s]:
            pair = s * meta.num_modules + m
            if lengths[s] <= MAX_SHORT_LEN:
                bag_keys.setdefault((rank, meta.out_dims[m] // bag_chunk), []).append(pair)
            else:
                long_keys.setdefault((rank, meta.out_dims[m], s), []).append(pair)
    expand = []
    for (rank, out_dim, s), pairs in long_keys.items():
        flat = rows.pair_first[pairs][:, None] + np.arange(rank)  # [num_items, rank]
        token_ids = np.arange(starts[s], starts[s + 1])  # [num_tokens]
        v_index = token_ids[None, :, None] * meta.v_width + rows.cols[flat][:, None, :]  # [items, tokens, rank]
        y_first = token_ids[None, :] * meta.y_width + rows.out_offset[pairs][:, None]  # [num_items, num_tokens]
        expand.append(
            ExpandBatch(
                num_items=len(pairs),
                rank=rank,
                out_dim=out_dim,
                num_tokens=len(token_ids),
                weight_chunks=tensor(_chunks(rows.addr_b[flat], out_dim, chunk)),
                v_index=tensor(v_index),
                y_chunks=tensor(_chunks(y_first, out_dim, y_chunk)),
            )
        )
    return SgmvTorchPlan(
        meta=meta,
        chunk=chunk,
        y_chunk=y_chunk,
        bag_chunk=bag_chunk,
        shrink=tuple(shrink),
        expand=tuple(expand),
        bags=_plan_bags(meta, rows, bag_keys, bag_chunk, tensor) if bag_keys else None,
    )


def _plan_bags(
    meta: SgmvMetadata,
    rows: "_PairRows",
    keys: dict[tuple[int, int], list[int]],
    bag_chunk: int,
    tensor: Callable[[np.ndarray], torch.Tensor],
) -> ExpandBags:
    """One bag per (token, module, output piece) of the short pairs, bag after bag; each holds the
    pair's ``rank`` Bᵀ row pieces (index = row piece, weight = the token's v column)."""
    indices, v_index, y_chunks, sizes = [], [], [], []
    for (rank, pieces), pairs in keys.items():
        pairs = np.array(pairs)  # [num_pairs]
        segments = pairs // meta.num_modules  # [num_pairs]
        lengths = rows.seg_starts[segments + 1] - rows.seg_starts[segments]  # [num_pairs]
        pair = np.repeat(pairs, lengths)  # [num_pair_tokens], one entry per (pair, token of its segment)
        within = np.arange(pair.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # [num_pair_tokens]
        token = np.repeat(rows.seg_starts[segments], lengths) + within  # [num_pair_tokens]
        flat = rows.pair_first[pair][:, None] + np.arange(rank)  # [num_pair_tokens, rank]
        piece = np.arange(pieces)  # [pieces]
        indices.append(rows.addr_b[flat][:, None, :] // bag_chunk + piece[None, :, None])  # [pt, pieces, rank]
        weights = token[:, None] * meta.v_width + rows.cols[flat]  # [num_pair_tokens, rank]
        v_index.append(np.broadcast_to(weights[:, None, :], (pair.size, pieces, rank)))  # [pt, pieces, rank]
        y_first = token * meta.y_width + rows.out_offset[pair]  # [num_pair_tokens]
        y_chunks.append(y_first[:, None] // bag_chunk + piece[None, :])  # [num_pair_tokens, pieces]
        sizes.append(np.full(pair.size * pieces, rank))  # [num_pair_tokens * pieces]
    bag_sizes = np.concatenate(sizes)  # [num_bags]
    return ExpandBags(
        indices=tensor(np.concatenate([i.reshape(-1) for i in indices])),
        offsets=tensor(np.cumsum(bag_sizes) - bag_sizes),
        v_index=tensor(np.concatenate([i.reshape(-1) for i in v_index])),
        y_chunks=tensor(np.concatenate([i.reshape(-1) for i in y_chunks])),
    )


class _PairRows:
    """Every (segment, module) pair's rows, flattened pair after pair (segment-major), with no Python loop
    per row: the j-th row of pair p sits at ``pair_first[p] + j`` of ``addr_a``, ``addr_b`` and ``cols``."""

    def __init__(self, meta: SgmvMetadata) -> None:
        ranks = np.array(meta.ranks_list, dtype=np.int64).reshape(-1)  # [num_pairs]
        self.pair_first = np.cumsum(ranks) - ranks  # [num_pairs]
        self.segment_first = self.pair_first.reshape(meta.num_segments, meta.num_modules)[:, 0]  # [num_segments]
        pair_of_row = np.repeat(np.arange(ranks.size), ranks)  # [num_flat]
        j = np.arange(pair_of_row.size) - self.pair_first[pair_of_row]  # [num_flat], row within its pair
        row_addr = meta.row_addr.cpu().numpy()  # [num_rows]
        row_a = np.array(meta.row_start_a_list, dtype=np.int64).reshape(-1)[pair_of_row] + j  # [num_flat]
        row_b = np.array(meta.row_start_b_list, dtype=np.int64).reshape(-1)[pair_of_row] + j  # [num_flat]
        self.addr_a = row_addr[row_a]  # [num_flat]
        self.addr_b = row_addr[row_b]  # [num_flat]
        self.cols = np.array(meta.v_cols_list, dtype=np.int64).reshape(-1)[pair_of_row] + j  # [num_flat]
        self.out_offset = np.tile(np.array(meta.out_offsets, dtype=np.int64), meta.num_segments)  # [num_pairs]
        self.seg_starts = np.array(meta.seg_starts_list, dtype=np.int64)  # [num_segments + 1]
        self.dims = (meta.in_dim, *meta.out_dims)

    def chunk(self, page_size: int) -> int:
        """The largest piece that divides P, every row length and every row address read."""
        start = math.gcd(page_size, *self.dims)
        return int(np.gcd.reduce(np.concatenate([self.addr_a, self.addr_b, [start]])))


def sgmv_shrink_torch(
    x: torch.Tensor,
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    plan: SgmvTorchPlan | None = None,
) -> torch.Tensor:
    """Torch implementation of :func:`kernels.sgmv_shrink.sgmv_shrink` (same semantics)."""
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
    """Torch implementation of :func:`kernels.sgmv_expand.sgmv_expand` (same semantics)."""
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


def _chunks(first: np.ndarray, length: int, chunk: int) -> np.ndarray:
    """Piece ids of rows of ``length`` elements starting at elements ``first``, row after row:
    ``first``'s shape with ``length / chunk`` appended."""
    return (first // chunk)[..., None] + np.arange(length // chunk)  # [*first.shape, length / chunk]


class _ItemTokens:
    """The token rows of each shrink item (a set of segments reading the same rows), item after item."""

    def __init__(self, seg_starts: np.ndarray, item_of_segment: np.ndarray, num_items: int) -> None:
        segments = np.flatnonzero(item_of_segment >= 0)  # [num_used]
        segments = segments[np.argsort(item_of_segment[segments], kind="stable")]  # [num_used], item order
        lengths = seg_starts[segments + 1] - seg_starts[segments]  # [num_used]
        first_token = np.cumsum(lengths) - lengths  # [num_used]
        self.segment = np.repeat(segments, lengths)  # [num_item_tokens], each token's segment
        within = np.arange(self.segment.size) - np.repeat(first_token, lengths)  # [num_item_tokens]
        self.row = seg_starts[self.segment] + within  # [num_item_tokens], each token's row of x
        items = item_of_segment[self.segment]  # [num_item_tokens]
        self.count = np.bincount(items, minlength=num_items)  # [num_items]
        self.first = np.cumsum(self.count) - self.count  # [num_items], the item's first token here
        self.first_segment = self.segment[self.first]  # [num_items], a segment holding the item's rows

    def padded(self, items: np.ndarray, pad_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each item's token rows and their segments, padded to ``pad_len`` by repeating the last token,
        and which are real: [num_items, pad_len] each."""
        position = np.arange(pad_len)[None, :]  # [1, pad_len]
        count = self.count[items][:, None]  # [num_items, 1]
        index = self.first[items][:, None] + np.minimum(position, count - 1)  # [num_items, pad_len]
        return self.row[index], self.segment[index], position < count
