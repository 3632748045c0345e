"""The CPU implementation's plan for SGMV shrink and expand: index tensors built once per step.

How the plan groups the work, and what it costs, is told in :mod:`loraplex_kernels.sgmv.sgmv_torch`, which runs it.
"""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex_kernels.sgmv.lora_metadata import SgmvMetadata

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
