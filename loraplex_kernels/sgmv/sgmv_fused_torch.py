"""SGMV shrink and expand fused, in plain torch: how the engine applies a module group's LoRA on CPU.

``y += (x @ Aᵀ) @ Bᵀ`` for every segment with its adapter's rows of one layer, in a few calls per layer.
A plan, built once per step and module group (layer independent), lists:

- the pieces of every row the step reads, each adapter's rows once however many segments read them:
  per layer one ``index_select`` copies them into one buffer, A rows first (module after module, the
  step's adapters in order within a module: the "columns"), then each module's Bᵀ rows in the same order;
- the short segments (decode tokens: at most ``MAX_SHORT_LEN`` tokens each), done together: their rows
  (a span of x, or gathered when a long segment lies among them) times every column at once (one ``mm``),
  a 0/1 mask keeping each token's own adapter's columns, then one ``addmm_`` (or ``index_add_``) per
  module into its columns of y. Each token also multiplies the other adapters' columns, a waste that
  grows with their number: past ``MAX_DENSE_ITEMS`` adapters among the short segments, the plan runs the
  separate ops (:mod:`loraplex_kernels.sgmv.sgmv_torch`) instead;
- each long segment (a prefill chunk) on its own: an ``mm`` and an ``addmm_`` per module, on views of x,
  y and the buffer, nothing copied.

The separate ops issue an ``index_select``, ``bmm`` or ``index_add_`` per batch of equal rank and token
count, and a torch call has a fixed cost however small it is: with few adapters a decode step's LoRA is
almost all calls, which fusing removes (figures: docs/benchmarks.md#sgmv-on-cpu-bench_sgmv_cpupy).
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex_kernels.sgmv.lora_metadata import SgmvMetadata, segment_items
from loraplex_kernels.sgmv.sgmv_torch import layer_pieces, sgmv_expand_torch, sgmv_shrink_torch
from loraplex_kernels.sgmv.sgmv_torch_plan import MAX_SHORT_LEN, SgmvTorchPlan, plan_sgmv_torch

# Past this many adapters among the short segments the dense product's waste (every token times every
# adapter's columns) costs more than the separate ops' calls: measured where the two cross
# (docs/benchmarks.md#sgmv-on-cpu-bench_sgmv_cpupy).
MAX_DENSE_ITEMS = 6


@dataclass(frozen=True, slots=True)
class LongModule:
    """One module of a long segment: its A rows in the buffer's A part, its Bᵀ rows' first element."""

    module: int
    first_a_row: int
    b_start: int
    rank: int


@dataclass(frozen=True, slots=True)
class LongSegment:
    first_token: int
    end_token: int
    modules: tuple[LongModule, ...]


@dataclass(frozen=True, slots=True)
class SgmvFusedPlan:
    """The fused CPU implementation's work for one step and module group; valid for every layer."""

    meta: SgmvMetadata = field(repr=False)  # the metadata planned for; the op refuses any other
    chunk: int  # elements per gathered piece: divides P, every row length and every row address read
    pieces: torch.Tensor  # [num_pieces] int64, the buffer's pieces of the pool at layer 0
    num_cols: int  # A rows in the buffer (the sum of every adapter's ranks over the modules)
    module_cols: tuple[tuple[int, int], ...]  # per module, its columns [first, end) among the A rows
    b_starts: tuple[int, ...]  # per module, the buffer element where its Bᵀ rows start
    dense_tokens: tuple[int, int] | None  # token rows [first, end) spanning every short segment, read as views
    dense_rows: torch.Tensor | None  # [num_short_tokens] int64: the short segments' rows, gathered (else None)
    dense_mask: torch.Tensor | None  # [dense rows, num_cols], 1 where the token reads the column; None: all 1
    long: tuple[LongSegment, ...]
    separate: SgmvTorchPlan | None  # set when the short segments read too many adapters: the separate ops' plan


def plan_sgmv_fused_torch(storage: torch.Tensor, meta: SgmvMetadata) -> SgmvFusedPlan:
    """Plan :func:`sgmv_fused_torch` for ``meta``, once per step (layer independent).

    ``storage`` ([num_pages, num_layers, P]) gives P, the dtype and the device; its contents are not read.
    """
    item_of_segment = segment_items(meta)
    starts = meta.seg_starts_list
    short_items = {
        item for s, item in enumerate(item_of_segment) if item >= 0 and starts[s + 1] - starts[s] <= MAX_SHORT_LEN
    }
    if len(short_items) > MAX_DENSE_ITEMS:
        return SgmvFusedPlan(
            meta=meta,
            chunk=1,
            pieces=torch.zeros(0, dtype=torch.int64, device=storage.device),
            num_cols=0,
            module_cols=(),
            b_starts=(),
            dense_tokens=None,
            dense_rows=None,
            dense_mask=None,
            long=(),
            separate=plan_sgmv_torch(storage, meta),
        )
    cols = _Columns(meta, item_of_segment)
    dims = [storage.shape[-1], meta.in_dim, *meta.out_dims]
    chunk = int(np.gcd.reduce(np.concatenate([cols.a_addr, *cols.b_addr, dims])))  # divides every row read
    pieces = [_row_pieces(cols.a_addr, meta.in_dim, chunk)]
    b_starts, next_elem = [], cols.num_cols * meta.in_dim
    for m, addr in enumerate(cols.b_addr):
        b_starts.append(next_elem)
        pieces.append(_row_pieces(addr, meta.out_dims[m], chunk))
        next_elem += addr.size * meta.out_dims[m]
    dense_tokens, dense_rows, dense_mask = _plan_dense(meta, item_of_segment, cols, storage)
    return SgmvFusedPlan(
        meta=meta,
        chunk=chunk,
        pieces=torch.from_numpy(np.concatenate(pieces).astype(np.int64)).to(storage.device),
        num_cols=cols.num_cols,
        module_cols=cols.module_cols,
        b_starts=tuple(b_starts),
        dense_tokens=dense_tokens,
        dense_rows=dense_rows,
        dense_mask=dense_mask,
        long=_plan_long(meta, item_of_segment, cols, b_starts),
        separate=None,
    )


class _Columns:
    """The buffer's columns: module after module, the items in order within a module, each its rank wide."""

    def __init__(self, meta: SgmvMetadata, item_of_segment: list[int]) -> None:
        first_segment = {item: s for s, item in reversed(list(enumerate(item_of_segment))) if item >= 0}
        row_addr = meta.row_addr.cpu().numpy()  # [num_rows]
        self.first_col = np.zeros((len(first_segment), meta.num_modules), dtype=np.int64)  # [items, modules]
        a_rows: list[np.ndarray] = []
        b_rows: list[list[np.ndarray]] = [[] for _ in range(meta.num_modules)]
        module_cols, num_cols = [], 0
        for m in range(meta.num_modules):
            module_first = num_cols
            for item in range(len(first_segment)):
                s = first_segment[item]
                rank = meta.ranks_list[s][m]
                self.first_col[item, m] = num_cols
                if rank:
                    a_rows.append(np.arange(meta.row_start_a_list[s][m], meta.row_start_a_list[s][m] + rank))
                    b_rows[m].append(np.arange(meta.row_start_b_list[s][m], meta.row_start_b_list[s][m] + rank))
                    num_cols += rank
            module_cols.append((module_first, num_cols))
        self.num_cols = num_cols
        self.module_cols = tuple(module_cols)
        self.a_addr = row_addr[np.concatenate(a_rows)] if a_rows else np.zeros(0, dtype=np.int64)  # [num_cols]
        self.b_addr = [row_addr[np.concatenate(rows)] if rows else np.zeros(0, dtype=np.int64) for rows in b_rows]


def _plan_dense(
    meta: SgmvMetadata, item_of_segment: list[int], cols: _Columns, storage: torch.Tensor
) -> tuple[tuple[int, int] | None, torch.Tensor | None, torch.Tensor | None]:
    """The short segments' rows (a span, or gathered when a long segment lies among them) and their mask."""
    starts = meta.seg_starts_list
    short = [s for s, item in enumerate(item_of_segment) if item >= 0 and starts[s + 1] - starts[s] <= MAX_SHORT_LEN]
    if not short:
        return None, None, None
    first, end = starts[short[0]], starts[short[-1] + 1]
    long_inside = any(
        item >= 0 and starts[s + 1] - starts[s] > MAX_SHORT_LEN and first <= starts[s] < end
        for s, item in enumerate(item_of_segment)
    )
    dense_tokens, dense_rows = None, None
    if long_inside:  # a prefill chunk between short segments: gather the short rows rather than span it
        rows = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in short])  # [num_short_tokens]
        dense_rows = torch.from_numpy(rows).to(storage.device)
    else:
        dense_tokens, rows = (first, end), np.arange(first, end)  # [span]
    row_of_token = {int(token): index for index, token in enumerate(rows)}
    mask = np.zeros((rows.size, cols.num_cols), dtype=np.float32)  # [dense rows, num_cols]
    for s in short:
        lo, hi = row_of_token[starts[s]], row_of_token[starts[s]] + starts[s + 1] - starts[s]
        for m, rank in enumerate(meta.ranks_list[s]):
            col = cols.first_col[item_of_segment[s], m]
            mask[lo:hi, col : col + rank] = 1.0
    dense_mask = None if mask.all() else torch.from_numpy(mask).to(device=storage.device, dtype=storage.dtype)
    return dense_tokens, dense_rows, dense_mask


def _plan_long(
    meta: SgmvMetadata, item_of_segment: list[int], cols: _Columns, b_starts: list[int]
) -> tuple[LongSegment, ...]:
    """Each long segment's modules: where its A rows and Bᵀ rows sit in the buffer."""
    starts = meta.seg_starts_list
    long = []
    for s, item in enumerate(item_of_segment):
        if item < 0 or starts[s + 1] - starts[s] <= MAX_SHORT_LEN:
            continue
        modules = tuple(
            LongModule(
                module=m,
                first_a_row=int(cols.first_col[item, m]),
                b_start=b_starts[m] + int(cols.first_col[item, m] - cols.module_cols[m][0]) * meta.out_dims[m],
                rank=rank,
            )
            for m, rank in enumerate(meta.ranks_list[s])
            if rank
        )
        long.append(LongSegment(starts[s], starts[s + 1], modules))
    return tuple(long)


def sgmv_fused_torch(
    x: torch.Tensor,
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    y: torch.Tensor,
    plan: SgmvFusedPlan | None = None,
) -> None:
    """Torch implementation of :func:`loraplex_kernels.sgmv.sgmv_fused.sgmv_fused` (same semantics)."""
    if plan is None:
        plan = plan_sgmv_fused_torch(storage, meta)
    if plan.separate is not None:  # the separate ops check their plan (it is planned for the same meta)
        v = sgmv_shrink_torch(x, storage, meta, layer_offset, plan.separate)  # [num_tokens, v_width]
        sgmv_expand_torch(v, storage, meta, layer_offset, y, plan.separate)
        return
    pool = layer_pieces(storage, meta, plan, layer_offset, plan.chunk)  # [pieces, chunk], a view
    if not plan.num_cols:
        return
    buffer = pool.index_select(0, plan.pieces).view(-1)  # [num_pieces * chunk]: A rows, then each module's Bᵀ rows
    a = buffer[: plan.num_cols * meta.in_dim].view(plan.num_cols, meta.in_dim)  # [num_cols, in_dim]
    if plan.dense_tokens is not None or plan.dense_rows is not None:
        if plan.dense_rows is None:
            first, end = plan.dense_tokens
            xs = x[first:end]  # [dense rows, in_dim]
        else:
            xs = x.index_select(0, plan.dense_rows)  # [dense rows, in_dim]
        v = torch.mm(xs, a.t())  # [dense rows, num_cols]
        if plan.dense_mask is not None:
            v.mul_(plan.dense_mask)
        for m, (col, end_col) in enumerate(plan.module_cols):
            if end_col == col:
                continue
            bt = _bt(buffer, meta, m, plan.b_starts[m], end_col - col)  # [module cols, out_dim]
            if plan.dense_rows is None:
                _module_columns(y, meta, m)[first:end].addmm_(v[:, col:end_col], bt)
            else:
                _module_columns(y, meta, m).index_add_(0, plan.dense_rows, torch.mm(v[:, col:end_col], bt))
    for segment in plan.long:
        xs = x[segment.first_token : segment.end_token]  # [seg_len, in_dim]
        for mod in segment.modules:
            vs = torch.mm(xs, a[mod.first_a_row : mod.first_a_row + mod.rank].t())  # [seg_len, rank]
            out = _module_columns(y, meta, mod.module)[segment.first_token : segment.end_token]  # [seg_len, out_dim]
            out.addmm_(vs, _bt(buffer, meta, mod.module, mod.b_start, mod.rank))


def _module_columns(y: torch.Tensor, meta: SgmvMetadata, m: int) -> torch.Tensor:
    """Module ``m``'s columns of y: [num_tokens, out_dims[m]], a view."""
    return y[:, meta.out_offsets[m] : meta.out_offsets[m] + meta.out_dims[m]]


def _bt(buffer: torch.Tensor, meta: SgmvMetadata, m: int, start: int, rank: int) -> torch.Tensor:
    """``rank`` Bᵀ rows of module ``m`` from buffer element ``start``: [rank, out_dims[m]], a view."""
    return buffer[start : start + rank * meta.out_dims[m]].view(rank, meta.out_dims[m])


def _row_pieces(addr: np.ndarray, length: int, chunk: int) -> np.ndarray:
    """Piece ids of rows of ``length`` elements starting at ``addr``, row after row: [rows * length / chunk]."""
    return ((addr // chunk)[:, None] + np.arange(length // chunk)).reshape(-1)
