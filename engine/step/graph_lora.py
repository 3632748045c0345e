"""The adapter tables of a CUDA graph's decode steps: each module group's SGMV tables at fixed shapes.

A graph fixes the SGMV kernels' grids and the addresses and shapes of their tables, so the graphs of steps with
adapters are captured per :class:`LoraCapacity` as well as per batch size: the step's module groups, a rank
bound (the shrink kernel's grid of rank tiles and the width of ``v``) and a bound on segments and token tiles,
each rounded up to a power of two so that few graphs serve every mix of adapters. :class:`GraphLoraTables`
holds one capacity's tables in a :class:`DeviceMirror`; a step writes its own tables into their first rows
and the rest of the tile list points past every segment's end, so the kernels' programs there exit at once
(tiles are the only rows the kernels start from: the other tables' rows past the step's are never read). A
step whose tables are the ones already loaded (the engine's memo hands out the same tables while the adapter
runs stay the same) copies nothing.
"""

from dataclasses import dataclass

import torch

from engine.adapters.adapter_layout import row_alignment
from engine.adapters.lora_batch import MODULE_GROUPS, LoraGroup, LoraStep
from engine.memory.device_mirror import DeviceMirror, FieldSpec
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.sgmv.lora_metadata import SKIP, SgmvMetadata

_TABLES = ("seg_starts", "row_start_a", "row_start_b", "ranks", "v_cols", "row_addr", "tiles")
_MIN_RANK = 16  # the kernels' tile of ranks: a smaller rank launches as many programs


def _power_of_two_at_least(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


@dataclass(frozen=True, slots=True)
class LoraCapacity:
    """What a graph's adapter tables hold: the step's module groups, its largest rank rounded up to a power of
    two number of rank tiles, and its segments and token tiles (each group's) rounded up to a power of two."""

    groups: tuple[str, ...]
    rank: int  # sizes the shrink kernel's grid of rank tiles and v's width per module
    segments: int  # rows of each group's segment tables and of its tile list

    @classmethod
    def of(cls, lora: LoraStep) -> "LoraCapacity":
        metas = [group.meta for group in lora.groups.values()]
        return cls(
            groups=tuple(name for name in MODULE_GROUPS if name in lora.groups),
            rank=max(_MIN_RANK, _power_of_two_at_least(max(meta.max_rank for meta in metas))),
            segments=_power_of_two_at_least(max(max(meta.num_segments, meta.num_tiles) for meta in metas)),
        )


class GraphLoraTables:
    """One capacity's SGMV tables for ``rows`` tokens, as device tensors a graph reads (``step``).

    ``example`` is a step of this capacity: its groups' input and output widths are the model's, the same for
    every step.
    """

    def __init__(self, capacity: LoraCapacity, example: LoraStep, rows: int, device: torch.device):
        self.capacity = capacity
        self._rows = rows
        self.row_align = row_alignment(example.page_elems)  # what every step's row addresses are multiples of
        fields: dict[str, FieldSpec] = {}
        for name in capacity.groups:
            num_modules = example.groups[name].meta.num_modules
            fields |= _group_fields(name, capacity, num_modules)
        self._mirror = DeviceMirror(fields, device)
        groups = {}
        for name in capacity.groups:
            meta = example.groups[name].meta
            self._mirror.host[f"{name}.out_dims_table"].copy_(meta.out_dims_table)
            self._mirror.host[f"{name}.out_offsets_table"].copy_(meta.out_offsets_table)
            groups[name] = LoraGroup(self._frame(name, meta), None)
        self.step = LoraStep(groups, example.page_elems, KernelBackend.TRITON)
        self._loaded: LoraStep | None = None
        self.clear()

    def clear(self) -> None:
        """Every tile past every segment: the kernels read no adapter row (what a capture runs on)."""
        for name in self.capacity.groups:
            self._pad_tiles(name, 0)
        self._mirror.upload()
        self._loaded = None

    def load(self, lora: LoraStep) -> None:
        """``lora``'s tables (a step of this capacity, on the host) into the graph's, unless they are there."""
        if lora is self._loaded:
            return
        host = self._mirror.host
        for name in self.capacity.groups:
            meta = lora.groups[name].meta
            for table in _TABLES:
                source = getattr(meta, table)
                host[f"{name}.{table}"][: source.shape[0]].copy_(source)
            self._pad_tiles(name, meta.num_tiles)
        self._mirror.upload()
        self._loaded = lora  # held, so its identity cannot pass to other tables while it is the one loaded

    def _pad_tiles(self, name: str, start: int) -> None:
        """Tiles ``start:`` of group ``name``: segment 0 from the last row on, past its end, so they exit."""
        tiles = self._mirror.host[f"{name}.tiles"]  # [segments, 2]
        tiles[start:, 0] = 0
        tiles[start:, 1] = self._rows

    def _frame(self, name: str, meta: SgmvMetadata) -> SgmvMetadata:
        """The group's metadata over the graph's tables, sized by the capacity.

        Only the Triton kernels read it, and they read only the tensors; its host values are the launch's
        shapes (``rows`` tokens in ``segments`` segments, ``v`` of ``rank`` columns per module), not a step's.
        """
        capacity = self.capacity
        device = self._mirror.device
        num_modules = meta.num_modules
        none = ((SKIP,) * num_modules,) * capacity.segments
        zeros = ((0,) * num_modules,) * capacity.segments
        return SgmvMetadata(
            **{table: device[f"{name}.{table}"] for table in _TABLES},
            out_dims_table=device[f"{name}.out_dims_table"],
            out_offsets_table=device[f"{name}.out_offsets_table"],
            in_dim=meta.in_dim,
            out_dims=meta.out_dims,
            out_offsets=meta.out_offsets,
            v_width=num_modules * capacity.rank,
            max_rank=capacity.rank,
            max_row_end=0,  # the pool bound is checked on each step's own tables (DecodeGraphs.fits)
            row_align=self.row_align,  # every step's, as DecodeGraphs.fits checks
            out_align=meta.out_align,  # the model's widths: every step's
            seg_starts_list=(0,) * capacity.segments + (self._rows,),
            row_start_a_list=none,
            row_start_b_list=none,
            ranks_list=zeros,
            v_cols_list=zeros,
        )


def _group_fields(name: str, capacity: LoraCapacity, num_modules: int) -> dict[str, FieldSpec]:
    """The tables of one group: ``segments`` rows each, and room in the row table for as many adapters with
    ``rank`` A and Bᵀ rows in every module."""
    segments = capacity.segments
    pair_table = ((segments, num_modules), torch.int32)
    return {
        f"{name}.seg_starts": ((segments + 1,), torch.int32),
        f"{name}.row_start_a": pair_table,
        f"{name}.row_start_b": pair_table,
        f"{name}.ranks": pair_table,
        f"{name}.v_cols": pair_table,
        f"{name}.row_addr": ((segments * num_modules * 2 * capacity.rank,), torch.int64),
        f"{name}.tiles": ((segments, 2), torch.int32),
        f"{name}.out_dims_table": ((num_modules,), torch.int32),
        f"{name}.out_offsets_table": ((num_modules,), torch.int32),
    }
