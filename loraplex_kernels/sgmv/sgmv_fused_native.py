"""SGMV shrink and expand fused in the native CPU library (``loraplex_kernels/csrc/sgmv_fused.cpp``).

One call per layer and module group reads each adapter's rows from the pool in place, once per tile of
the tokens that use it, wherever those tokens sit in the step: the plan, built once per step, lists the
tokens of each *item* (one adapter's rows, see :func:`loraplex_kernels.sgmv.lora_metadata.segment_items`). The torch
implementation instead gathers rows with ``index_select`` every layer and, past a few adapters among the
decode tokens, falls back to batched ``bmm`` with scatters, a large share of the engine's operator time
with many adapters (docs/benchmarks.md#sgmv-on-cpu-bench_sgmv_cpupy).

The pool may hold the rows in float32 or in bfloat16 (bf16 mode's pool, K/V and adapters in one tensor):
the op widens bf16 rows to fp32 in registers as it reads them, so x, y and every sum stay float32 and a
bf16 adapter streams half the bytes.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex_kernels.native_cpu import require_native_ops
from loraplex_kernels.sgmv.lora_metadata import SgmvMetadata, segment_items

NATIVE_STORAGE_DTYPES = (torch.float32, torch.bfloat16)  # the pools the op reads; x and y are float32


@dataclass(frozen=True, slots=True)
class SgmvNativePlan:
    """The items of one step and module group, valid for every layer."""

    meta: SgmvMetadata = field(repr=False)  # the metadata planned for; the op refuses any other
    token_ids: torch.Tensor  # [num_listed_tokens] int32: item 0's token rows, then item 1's, ...
    item_starts: torch.Tensor  # [num_items + 1] int32, where each item's tokens start in token_ids
    row_start_a: torch.Tensor  # [num_items, num_modules] int32, index into meta.row_addr of A's row 0
    row_start_b: torch.Tensor  # [num_items, num_modules] int32, index into meta.row_addr of Bᵀ's row 0
    ranks: torch.Tensor  # [num_items, num_modules] int32, 0 where the item's adapter skips the module


def plan_sgmv_native(meta: SgmvMetadata) -> SgmvNativePlan:
    """Group the segments' tokens by item, once per step (layer independent)."""
    item_of_segment = segment_items(meta)
    num_items = max(item_of_segment, default=-1) + 1
    tokens: list[list[np.ndarray]] = [[] for _ in range(num_items)]
    first_segment = [-1] * num_items
    starts = meta.seg_starts_list
    for s, item in enumerate(item_of_segment):
        if item < 0:
            continue
        tokens[item].append(np.arange(starts[s], starts[s + 1], dtype=np.int32))
        if first_segment[item] < 0:
            first_segment[item] = s
    counts = [sum(run.size for run in runs) for runs in tokens]
    token_ids = np.concatenate([run for runs in tokens for run in runs]) if num_items else np.zeros(0, np.int32)

    def table(rows: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        picked = [rows[s] for s in first_segment]
        return torch.tensor(picked, dtype=torch.int32).view(num_items, meta.num_modules)  # [num_items, num_modules]

    return SgmvNativePlan(
        meta=meta,
        token_ids=torch.from_numpy(token_ids),  # [num_listed_tokens]
        item_starts=torch.tensor([0, *np.cumsum(counts, dtype=np.int64).tolist()], dtype=torch.int32),  # [items + 1]
        row_start_a=table(meta.row_start_a_list),
        row_start_b=table(meta.row_start_b_list),
        ranks=table(meta.ranks_list),
    )


def sgmv_fused_native(
    x: torch.Tensor,
    storage: torch.Tensor,
    meta: SgmvMetadata,
    layer_offset: int,
    y: torch.Tensor,
    plan: SgmvNativePlan | None = None,
) -> None:
    """Native implementation of :func:`loraplex_kernels.sgmv.sgmv_fused.sgmv_fused` (same semantics; float32 x and y on
    CPU).

    ``storage`` is the float32 or bfloat16 pool [num_pages, num_layers, P]; row addresses and
    ``layer_offset`` count its own elements. The op checks every row address against the pool and every
    token against x before it reads.
    """
    if plan is None:
        plan = plan_sgmv_native(meta)
    if plan.meta is not meta:
        raise ValueError("the plan was made for other metadata; plan once per step with this step's metadata")
    require_native_ops().sgmv_fused(
        x,
        storage,
        layer_offset,
        plan.token_ids,
        plan.item_starts,
        plan.row_start_a,
        plan.row_start_b,
        plan.ranks,
        meta.row_addr,
        meta.out_dims_table,
        meta.out_offsets_table,
        y,
    )
