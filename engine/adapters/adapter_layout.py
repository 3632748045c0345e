"""Where an adapter's LoRA rows sit in its pages (docs/architecture.md#adapters-in-the-pool), and copying them there.

For each target module m, in the order of ``PROJECTIONS``, the adapter stores ``A_m`` (r_m rows of
in_m) then ``B_mᵀ`` (r_m rows of out_m). Rows are laid out one after another in the pages' layer
slices, each starting at a multiple of ROW_ALIGN elements; a row that does not fit the rest of a page
starts the next page, so no row straddles a page and every row is contiguous. Every layer uses the same
offsets, so one row table serves all layers: the address of row i at layer l is ``row_addr[i] + l * P``
in the flat pool. With P a multiple of ROW_ALIGN, as a pool of 16-token blocks is, every row address
is one too, so the Triton SGMV kernels read rows with 16-byte loads (``SgmvMetadata.row_align``).

A module whose rank differs between layers (``rank_pattern`` keyed by layer) gets the largest of its
ranks; the extra rows of the other layers hold zeros, which add nothing.
"""

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.adapters.lora_adapter import LoraAdapter
from engine.adapters.lora_config import PROJECTIONS, projection_shapes
from engine.config import ModelConfig

ROW_ALIGN = 16  # elements: where each row starts in a page's layer slice


@dataclass(frozen=True, slots=True)
class RowGroup:
    """The rows of one module's A (``kind == "a"``) or Bᵀ (``kind == "b"``)."""

    module: str
    kind: str
    num_rows: int
    dim: int
    first_row: int  # index of the group's first row in the adapter's row table


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    """An adapter's rows placed in ``num_pages`` pages: (page index, offset) of every row."""

    groups: tuple[RowGroup, ...]
    row_pages: tuple[int, ...]  # [num_rows] index into the adapter's page list
    row_offsets: tuple[int, ...]  # [num_rows] element offset inside a page's layer slice
    num_pages: int

    def row_addr(self, page_ids: list[int], num_layers: int, page_elems: int) -> torch.Tensor:
        """Flat pool address of each row at layer 0, once the adapter owns ``page_ids``."""
        pages = torch.tensor([page_ids[i] for i in self.row_pages], dtype=torch.int64)  # [num_rows]
        offsets = torch.tensor(self.row_offsets, dtype=torch.int64)  # [num_rows]
        return pages * (num_layers * page_elems) + offsets  # [num_rows]

    def group(self, module: str, kind: str) -> RowGroup | None:
        for group in self.groups:
            if group.module == module and group.kind == kind:
                return group
        return None


def plan_layout(adapter: LoraAdapter, model: ModelConfig, page_elems: int) -> AdapterLayout:
    shapes = projection_shapes(model)
    groups: list[RowGroup] = []
    dims: list[int] = []
    for module in adapter.modules:
        in_dim, out_dim = shapes[module]
        for kind, dim in (("a", in_dim), ("b", out_dim)):
            rank = adapter.ranks[module]
            groups.append(RowGroup(module, kind, rank, dim, len(dims)))
            dims += [dim] * rank
    places = list(_row_places(dims, page_elems))
    row_pages = tuple(page for page, _ in places)
    row_offsets = tuple(offset for _, offset in places)
    return AdapterLayout(tuple(groups), row_pages, row_offsets, row_pages[-1] + 1 if places else 0)


def pages_for_rank(model: ModelConfig, rank: int, page_elems: int) -> int:
    """Pages an adapter of ``rank`` on every projection takes (rows packed as :func:`plan_layout` packs them)."""
    shapes = projection_shapes(model)
    dims = [dim for module in PROJECTIONS for dim in shapes[module] for _ in range(rank)]
    places = list(_row_places(dims, page_elems))
    return places[-1][0] + 1 if places else 1


def row_alignment(page_elems: int) -> int:
    """What every row address of a layout is a multiple of, at every layer of a pool of ``page_elems`` (P):
    rows start at multiples of ROW_ALIGN in their pages, pages and layers at multiples of P."""
    return math.gcd(ROW_ALIGN, page_elems)


def _row_places(dims: list[int], page_elems: int) -> Iterator[tuple[int, int]]:
    """(page index, element offset) of each row of ``dims`` elements, one after another from page 0, each
    starting at a multiple of ROW_ALIGN and in a page whose rest holds it whole."""
    page, offset = 0, 0
    for dim in dims:
        offset = -(-offset // ROW_ALIGN) * ROW_ALIGN
        if offset + dim > page_elems:
            page, offset = page + 1, 0
        yield page, offset
        offset += dim


def group_rows(adapter: LoraAdapter, group: RowGroup, num_layers: int) -> torch.Tensor:
    """The group's rows for every layer, [num_layers, num_rows, dim], zeros where a layer has fewer."""
    rows = torch.zeros(num_layers, group.num_rows, group.dim)  # [L, rows, dim]
    for layer, weights in enumerate(adapter.layers):
        lora = weights.get(group.module)
        if lora is None:
            continue
        block = lora.a if group.kind == "a" else lora.b.T  # [rank, dim]
        rows[layer, : block.shape[0]] = block
    return rows


def write_adapter(storage: torch.Tensor, page_ids: list[int], adapter: LoraAdapter, layout: AdapterLayout) -> None:
    """Copy every row of ``adapter`` into its pages of ``storage`` [num_pages, num_layers, P]."""
    num_layers = storage.shape[1]
    for group in layout.groups:
        rows = group_rows(adapter, group, num_layers).to(storage.dtype)  # [L, rows, dim]
        start = 0
        while start < group.num_rows:  # one copy per run of rows sharing a page
            first = group.first_row + start
            page = layout.row_pages[first]
            end = start
            while end < group.num_rows and layout.row_pages[group.first_row + end] == page:
                end += 1
            offset = layout.row_offsets[first]
            run = rows[:, start:end].reshape(num_layers, -1)  # [L, run_rows * dim]
            storage[page_ids[page], :, offset : offset + run.shape[1]] = run.to(storage.device)
            start = end


def pack_pages(
    adapter: LoraAdapter, layout: AdapterLayout, num_layers: int, page_elems: int, dtype: torch.dtype
) -> torch.Tensor:
    """The adapter's pages as they sit in the pool, [num_pages, num_layers, P] in ``dtype`` on the host.

    The rows are rounded to ``dtype`` here, once (bf16: to nearest even, torch's conversion), from the
    adapter's float32 values with the LoRA scale already folded into B. Elements no row covers are zero.
    Copying page ``i`` of the result into the ``i``-th page the adapter owns loads it: the host tier keeps
    this, so a load is a copy of pages and nothing is laid out again.
    """
    pages = torch.zeros(layout.num_pages, num_layers, page_elems, dtype=dtype)  # [num_pages, L, P]
    write_adapter(pages, list(range(layout.num_pages)), adapter, layout)
    return pages
