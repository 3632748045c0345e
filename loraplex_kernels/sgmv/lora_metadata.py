"""Which LoRA rows each segment of a step's tokens reads, for one group of projections sharing an input.

The step's tokens are sorted so that rows sharing an adapter are contiguous: segment ``s`` covers token
rows ``seg_starts[s]:seg_starts[s + 1]``. A *module group* is a set of projections that read the same
input (q/k/v read the attention norm's output; gate/up read the MLP norm's output), numbered
``m = 0..num_modules-1``; one SGMV launch serves the whole group, so each group has its own metadata.

Adapter weights live in the unified page pool (docs/architecture.md) as rows: ``A_m`` (``r`` rows of ``in_dim``)
and ``B_mᵀ`` (``r`` rows of ``out_dims[m]``; row ``j`` of ``B_mᵀ`` is column ``j`` of ``B_m``, scale folded
in). ``row_addr[i]`` is the flat element index, in ``storage.view(-1)``, of row ``i`` at layer 0; the same
row at layer ``l`` starts ``l * P`` elements later. The kernels take ``layer_offset = l * P``.

The intermediate ``v`` holds, for each token, its segment's rank blocks side by side:
``v[t, v_cols[s, m] : v_cols[s, m] + ranks[s, m]]``. The builder lays them out cumulatively in module
order, so ``v``'s width is the largest total rank of one segment; nothing is padded to a global rank.

The Triton kernels run one program row per *token tile*: ``TOKENS_PER_TILE`` consecutive tokens of one
segment that reads adapter rows. ``tiles[i] = (segment, first token)`` lists them, so a step's grid is as long
as its tiles, whatever its segments' lengths: a prefill chunk of 512 tokens beside 200 one-token decode
segments is 232 tiles, not 201 × 32. A tile whose first token is at or past its segment's end does nothing,
which is how a table padded to a fixed length (a CUDA graph's) fills its unused rows.

``row_align`` and ``out_align`` are the largest powers of two up to MAX_ALIGN that divide every row address,
and every output width and offset: the kernels tell the compiler so (``tl.multiple_of``), which lets it read
a row's elements with 16-byte loads and stage them in shared memory ahead of use. The engine's adapter
layout starts every row at a multiple of 16 elements, so at model shapes both are 16.
"""

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from loraplex_kernels.host_tensor import host_tensor

SKIP = -1  # row_start_a / row_start_b of a (segment, module) that reads no adapter rows
TOKENS_PER_TILE = 16  # tokens of one program of the Triton kernels (tl.dot needs at least 16 a side)
MAX_ALIGN = 16  # elements: the most row_align and out_align claim (16-byte loads of fp32 need 4, of bf16 8)


class ModuleRows(NamedTuple):
    """One module of one adapter: where its A and Bᵀ rows start in ``row_addr``, and how many (its rank).

    Rows ``row_start_a .. row_start_a + rank - 1`` of the row table are ``A``'s rows in order, and
    likewise for ``Bᵀ``. A plain ``(row_start_a, row_start_b, rank)`` tuple is accepted too.
    """

    row_start_a: int
    row_start_b: int
    rank: int


# A segment as the builder takes it: its number of tokens, and per module the rows it reads, or None
# (the adapter does not target that module). ``None`` in place of the list: the segment has no adapter.
SegmentSpec = tuple[int, Sequence[ModuleRows | tuple[int, int, int] | None] | None]


@dataclass(frozen=True, slots=True)
class SgmvMetadata:
    """One module group's SGMV tables for one step; the same object serves every layer.

    A (segment, module) pair with ``ranks[s, m] == 0`` is skipped: its ``row_start_a``/``row_start_b`` are
    ``SKIP``; shrink leaves its ``v`` columns zero and expand leaves its ``y`` columns untouched.
    """

    seg_starts: torch.Tensor  # [num_segments + 1] int32, cumulative token rows
    row_start_a: torch.Tensor  # [num_segments, num_modules] int32, index into row_addr of A's row 0; SKIP
    row_start_b: torch.Tensor  # [num_segments, num_modules] int32, index into row_addr of Bᵀ's row 0; SKIP
    ranks: torch.Tensor  # [num_segments, num_modules] int32, 0 when skipped
    v_cols: torch.Tensor  # [num_segments, num_modules] int32, first column of the rank block in v
    row_addr: torch.Tensor  # [num_rows] int64, flat element index of each row at layer 0
    tiles: torch.Tensor  # [num_tiles, 2] int32, (segment, first token) of each token tile that reads rows
    out_dims_table: torch.Tensor  # [num_modules] int32, the same as out_dims, on the device
    out_offsets_table: torch.Tensor  # [num_modules] int32, the same as out_offsets, on the device
    in_dim: int
    out_dims: tuple[int, ...]  # each module's output width
    out_offsets: tuple[int, ...]  # each module's first column in y
    v_width: int  # columns of v: the largest sum of one segment's ranks
    max_rank: int  # the largest rank of any (segment, module)
    max_row_end: int  # the largest row_addr + row length over the rows read, at layer 0 (bounds check)
    row_align: int  # a power of two up to MAX_ALIGN dividing every row_addr
    out_align: int  # a power of two up to MAX_ALIGN dividing every out_dims and out_offsets
    seg_starts_list: tuple[int, ...]  # host copies of the tables above, for the CPU implementation
    row_start_a_list: tuple[tuple[int, ...], ...]
    row_start_b_list: tuple[tuple[int, ...], ...]
    ranks_list: tuple[tuple[int, ...], ...]
    v_cols_list: tuple[tuple[int, ...], ...]

    @property
    def num_segments(self) -> int:
        return len(self.seg_starts_list) - 1

    @property
    def num_modules(self) -> int:
        return len(self.out_dims)

    @property
    def num_tokens(self) -> int:
        return self.seg_starts_list[-1]

    @property
    def num_tiles(self) -> int:
        """Token tiles: the Triton kernels' programs along their grid's x axis."""
        return self.tiles.shape[0]

    @property
    def y_width(self) -> int:
        """Columns of the output ``y`` of the whole group (e.g. the fused qkv projection's width)."""
        return max(offset + dim for offset, dim in zip(self.out_offsets, self.out_dims, strict=True))


def build_sgmv_metadata(
    segments: Sequence[SegmentSpec],
    row_addr: Sequence[int],
    in_dim: int,
    out_dims: Sequence[int],
    device: torch.device | str = "cpu",
    out_offsets: Sequence[int] | None = None,
) -> SgmvMetadata:
    """Build one module group's metadata from host lists.

    Args:
        segments: per segment, in token order, ``(num_tokens, modules)``. ``modules`` is None for tokens
            that run the base model only, else one entry per module of the group: ``ModuleRows`` (or a
            ``(row_start_a, row_start_b, rank)`` tuple) into ``row_addr``, or None (or rank 0) when the
            adapter does not target that module. Two segments may name the same rows (the same adapter).
        row_addr: flat element index in ``storage.view(-1)`` of every row the segments name, at layer 0
            (``page * num_layers * P + offset_in_page``). Typically the step's adapters' row tables
            concatenated, each adapter's ``row_start_*`` shifted by where its table begins.
        in_dim: the group's input width (the length of every A row).
        out_dims: each module's output width (the length of its Bᵀ rows).
        device: where the tensors go (the device of x and the pool).
        out_offsets: each module's first column in ``y``; by default the modules sit side by side in order.

    Example (q/k/v of SmolLM2; adapter 0's rows at ``row_addr[0:...]``, 5 tokens then 3 base-model tokens):
        ``build_sgmv_metadata([(5, [(0, 8, 8), (16, 24, 8), None]), (3, None)], addrs, 576, (576, 192, 192))``
    """
    out_dims = tuple(int(dim) for dim in out_dims)
    num_modules = len(out_dims)
    if out_offsets is None:
        out_offsets = tuple(itertools.accumulate(out_dims, initial=0))[:-1]
    out_offsets = tuple(int(offset) for offset in out_offsets)
    if num_modules == 0 or len(out_offsets) != num_modules:
        raise ValueError(f"need one out_offset per module and at least one module, got {out_dims} / {out_offsets}")
    if in_dim < 1 or min(out_dims) < 1 or min(out_offsets) < 0:
        raise ValueError(f"dims must be positive and offsets non-negative: in {in_dim}, out {out_dims} @ {out_offsets}")
    num_rows = len(row_addr)

    seg_starts = [0]
    row_start_a: list[tuple[int, ...]] = []
    row_start_b: list[tuple[int, ...]] = []
    ranks: list[tuple[int, ...]] = []
    v_cols: list[tuple[int, ...]] = []
    v_width = 0
    max_row_end = 0
    row_ends: dict[tuple[int, int, int, int], int] = {}  # (module, start_a, start_b, rank): its rows' furthest end
    for index, (num_tokens, modules) in enumerate(segments):
        if num_tokens < 0:
            raise ValueError(f"segment {index} has {num_tokens} tokens")
        seg_starts.append(seg_starts[-1] + num_tokens)
        if modules is None:
            modules = [None] * num_modules
        if len(modules) != num_modules:
            raise ValueError(f"segment {index} lists {len(modules)} modules, the group has {num_modules}")
        starts_a, starts_b, seg_ranks, cols = [], [], [], []
        col = 0
        for module, rows in enumerate(modules):
            start_a, start_b, rank = (SKIP, SKIP, 0) if rows is None or rows[2] == 0 else rows
            if rank < 0 or (rank and not (0 <= start_a <= num_rows - rank and 0 <= start_b <= num_rows - rank)):
                raise ValueError(
                    f"segment {index} module {module}: rows {start_a}/{start_b} + rank {rank} "
                    f"fall outside the row table of {num_rows} rows"
                )
            if rank:
                rows_key = (module, start_a, start_b, rank)
                if rows_key not in row_ends:  # segments of one adapter name the same rows: read them once
                    row_ends[rows_key] = max(
                        max(row_addr[start_a : start_a + rank]) + in_dim,
                        max(row_addr[start_b : start_b + rank]) + out_dims[module],
                    )
                max_row_end = max(max_row_end, row_ends[rows_key])
            starts_a.append(start_a)
            starts_b.append(start_b)
            seg_ranks.append(rank)
            cols.append(col)
            col += rank
        v_width = max(v_width, col)
        row_start_a.append(tuple(starts_a))
        row_start_b.append(tuple(starts_b))
        ranks.append(tuple(seg_ranks))
        v_cols.append(tuple(cols))
    if not segments:
        raise ValueError("need at least one segment")
    if num_rows and min(row_addr) < 0:
        raise ValueError("row addresses must be non-negative")

    def tensor(values: Iterable[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return host_tensor(values, dtype).to(device)  # built on the host, then moved (a no-op there)

    def table(rows: list[tuple[int, ...]]) -> torch.Tensor:
        return tensor(itertools.chain.from_iterable(rows)).view(len(segments), num_modules)

    return SgmvMetadata(
        seg_starts=tensor(seg_starts),  # [num_segments + 1]
        row_start_a=table(row_start_a),  # [num_segments, num_modules]
        row_start_b=table(row_start_b),  # [num_segments, num_modules]
        ranks=table(ranks),  # [num_segments, num_modules]
        v_cols=table(v_cols),  # [num_segments, num_modules]
        row_addr=tensor(row_addr, torch.int64),  # [num_rows]
        tiles=tensor(_token_tiles(seg_starts, ranks)).view(-1, 2),  # [num_tiles, 2]
        out_dims_table=tensor(out_dims),  # [num_modules]
        out_offsets_table=tensor(out_offsets),  # [num_modules]
        in_dim=in_dim,
        out_dims=out_dims,
        out_offsets=out_offsets,
        v_width=v_width,
        max_rank=max(max(seg_ranks) for seg_ranks in ranks),
        max_row_end=max_row_end,
        row_align=math.gcd(MAX_ALIGN, *row_addr),
        out_align=math.gcd(MAX_ALIGN, *out_dims, *out_offsets),
        seg_starts_list=tuple(seg_starts),
        row_start_a_list=tuple(row_start_a),
        row_start_b_list=tuple(row_start_b),
        ranks_list=tuple(ranks),
        v_cols_list=tuple(v_cols),
    )


def check_sgmv_metadata(meta: SgmvMetadata, device: torch.device) -> None:
    """Raise ValueError unless the metadata's tensors have the dtypes, shapes and device the kernels read."""
    num_segments, num_modules = meta.num_segments, meta.num_modules
    expected = {
        "seg_starts": ((num_segments + 1,), torch.int32),
        "row_start_a": ((num_segments, num_modules), torch.int32),
        "row_start_b": ((num_segments, num_modules), torch.int32),
        "ranks": ((num_segments, num_modules), torch.int32),
        "v_cols": ((num_segments, num_modules), torch.int32),
        "row_addr": ((meta.row_addr.shape[0],), torch.int64),
        "tiles": ((meta.num_tiles, 2), torch.int32),
        "out_dims_table": ((num_modules,), torch.int32),
        "out_offsets_table": ((num_modules,), torch.int32),
    }
    for name, (shape, dtype) in expected.items():
        tensor = getattr(meta, name)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"meta.{name} must be {dtype} of shape {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
        if not tensor.is_contiguous() or tensor.device != device:
            raise ValueError(f"meta.{name} must be contiguous and on {device}, got {tensor.device}")


def with_segment_tokens(meta: SgmvMetadata, num_tokens: Sequence[int]) -> SgmvMetadata:
    """``meta`` with each segment's ``num_tokens`` in place of its own: the same segments and rows, other counts
    (a host tensor of ``seg_starts``, as the builder makes it on the host)."""
    if len(num_tokens) != meta.num_segments or min(num_tokens, default=0) < 0:
        raise ValueError(f"need {meta.num_segments} non-negative token counts, got {list(num_tokens)}")
    seg_starts = tuple(itertools.accumulate(num_tokens, initial=0))
    return dataclasses.replace(
        meta,
        seg_starts=host_tensor(seg_starts, torch.int32),  # [num_segments + 1]
        tiles=host_tensor(_token_tiles(seg_starts, meta.ranks_list), torch.int32).view(-1, 2),  # [num_tiles, 2]
        seg_starts_list=seg_starts,
    )


def _token_tiles(seg_starts: Sequence[int], ranks: Sequence[Sequence[int]]) -> list[int]:
    """``(segment, first token)`` of every token tile of the segments that read rows, flattened.

    Every tile holds a token and token indices are int32, so there are fewer than 2^31: they fit the x axis of
    a CUDA grid, where the kernels put them (y and z stop at 65,535).
    """
    tiles: list[int] = []
    for s, seg_ranks in enumerate(ranks):
        if not any(seg_ranks):
            continue
        for first in range(seg_starts[s], seg_starts[s + 1], TOKENS_PER_TILE):
            tiles += (s, first)
    return tiles


def segment_items(meta: SgmvMetadata) -> list[int]:
    """Each segment's item, -1 for a segment that reads no rows.

    An item is one set of adapter rows (the same A and Bᵀ rows of every module): segments that name the
    same rows, such as the decode tokens of one adapter scattered through a step, share one item, so an
    implementation can read those rows once for all of their tokens. Items are numbered in the order of
    their first segment.
    """
    starts = meta.seg_starts_list
    item_of_signature: dict[tuple[tuple[int, ...], ...], int] = {}
    item_of_segment = []
    for s in range(meta.num_segments):
        if starts[s + 1] > starts[s] and any(meta.ranks_list[s]):
            signature = (meta.row_start_a_list[s], meta.row_start_b_list[s], meta.ranks_list[s])
            item_of_segment.append(item_of_signature.setdefault(signature, len(item_of_signature)))
        else:
            item_of_segment.append(-1)
    return item_of_segment
