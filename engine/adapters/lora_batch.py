"""Per-step LoRA metadata: which rows of which adapters each run of tokens reads, per projection group.

The step's tokens keep the order the attention wants; consecutive tokens with the same adapter form
one SGMV segment. Projections that share an input go in one launch: q/k/v, o, gate/up, down.
"""

from dataclasses import dataclass

import torch

from engine.adapters.adapter_cache import AdapterEntry
from engine.adapters.lora_config import projection_shapes
from engine.config import ModelConfig
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.sgmv.lora_metadata import ModuleRows, SgmvMetadata, build_sgmv_metadata, with_segment_tokens
from loraplex_kernels.sgmv.sgmv_fused import sgmv_fused
from loraplex_kernels.sgmv.sgmv_fused_native import SgmvNativePlan, plan_sgmv_native
from loraplex_kernels.sgmv.sgmv_fused_torch import SgmvFusedPlan, plan_sgmv_fused_torch

MODULE_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True, slots=True)
class LoraGroup:
    meta: SgmvMetadata
    plan: SgmvFusedPlan | SgmvNativePlan | None  # the TORCH or NATIVE backend's plan; None for TRITON


@dataclass(frozen=True, slots=True)
class LoraStep:
    """The step's SGMV tables for each projection group that any of its adapters targets."""

    groups: dict[str, LoraGroup]
    page_elems: int
    backend: KernelBackend = KernelBackend.TORCH

    def targets(self, name: str) -> bool:
        """Whether any adapter of the step has rows in projection group ``name``."""
        return name in self.groups

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor, layer: int, storage: torch.Tensor) -> None:
        """``y += x @ A.T @ B.T`` per token with its adapter's rows of ``layer``, for group ``name``."""
        group = self.groups.get(name)
        if group is None:
            return
        sgmv_fused(x, storage, group.meta, layer * self.page_elems, y, plan=group.plan, backend=self.backend)


class LoraStepMemo:
    """The last step's tables, handed out again while a step's adapter runs are the same.

    In steady decoding each adapter's decode rows are one run (engine/step/step_batch.py groups them), so
    consecutive steps have the same runs until a sequence joins or leaves, or an adapter moves in the pool
    (a new row table). A step whose runs name the same adapters in the same order, with their row tables, as
    the last step's, reuses its tables: all of them when every run has the same tokens, and every table but
    the runs' token counts (and the backend's plan of them) when a sequence of a running adapter joined or
    left. Any other change builds them again.
    """

    def __init__(self) -> None:
        self._key: list[tuple[AdapterEntry | None, list[int] | None]] = []
        self._counts: list[int] = []
        self._storage: torch.Tensor | None = None
        self._backend: KernelBackend | None = None
        self._step: LoraStep | None = None

    def build(
        self,
        runs: list[tuple[int, AdapterEntry | None]],
        model: ModelConfig,
        storage: torch.Tensor,
        backend: KernelBackend = KernelBackend.TORCH,
    ) -> LoraStep | None:
        """:func:`build_lora_step`'s tables, made from the last step's where its adapter runs were the same."""
        segments = _merge_runs(runs)
        key = [(entry, None if entry is None else entry.row_addr_list) for _, entry in segments]
        counts = [num_tokens for num_tokens, _ in segments]
        if not (storage is self._storage and backend is self._backend and _same_adapters(key, self._key)):
            self._step = _build_lora_step(segments, model, storage, backend)
            self._key, self._storage, self._backend = key, storage, backend
        elif counts != self._counts and self._step is not None:
            self._step = _recount(self._step, counts, storage)
        self._counts = counts
        return self._step


def _same_adapters(
    key: list[tuple[AdapterEntry | None, list[int] | None]], last: list[tuple[AdapterEntry | None, list[int] | None]]
) -> bool:
    """The same adapters run after run, each with the row table it had (compared as objects: the memo holds
    them, so none is freed and its identity reused)."""
    return len(key) == len(last) and all(
        entry is last_entry and rows is last_rows
        for (entry, rows), (last_entry, last_rows) in zip(key, last, strict=True)
    )


def _recount(step: LoraStep, counts: list[int], storage: torch.Tensor) -> LoraStep:
    """``step``'s tables with each run's token count from ``counts`` (one per run, as the step's segments)."""
    groups = {}
    for name, group in step.groups.items():
        meta = with_segment_tokens(group.meta, counts)
        groups[name] = LoraGroup(meta, _plan(step.backend, storage, meta))
    return LoraStep(groups, step.page_elems, step.backend)


def build_lora_step(
    runs: list[tuple[int, AdapterEntry | None]],
    model: ModelConfig,
    storage: torch.Tensor,
    backend: KernelBackend = KernelBackend.TORCH,
) -> LoraStep | None:
    """Tables for the step's token runs (``(num_tokens, adapter)`` in token order); None without adapters.

    ``backend`` picks which implementation the plans are for (one per step and group; TRITON needs none).
    """
    return _build_lora_step(_merge_runs(runs), model, storage, backend)


def _build_lora_step(
    segments: list[tuple[int, AdapterEntry | None]], model: ModelConfig, storage: torch.Tensor, backend: KernelBackend
) -> LoraStep | None:
    if all(entry is None for _, entry in segments):
        return None
    shapes = projection_shapes(model)
    groups = {}
    for name, modules in MODULE_GROUPS.items():
        row_addr: list[int] = []
        starts: dict[int, dict[str, ModuleRows]] = {}
        specs = []
        for num_tokens, entry in segments:
            if entry is None or not any(m in entry.modules for m in modules):
                specs.append((num_tokens, None))
                continue
            if id(entry) not in starts:
                starts[id(entry)] = _append_rows(entry, modules, row_addr)
            rows = starts[id(entry)]
            specs.append((num_tokens, [rows.get(m) for m in modules]))
        if not row_addr:
            continue
        in_dim = shapes[modules[0]][0]
        meta = build_sgmv_metadata(
            specs, row_addr, in_dim, [shapes[m][1] for m in modules], device="cpu"
        )  # on the host: build_step_batch moves the step's tables to the device in one copy
        groups[name] = LoraGroup(meta, _plan(backend, storage, meta))
    return LoraStep(groups, storage.shape[2], backend)


def _plan(backend: KernelBackend, storage: torch.Tensor, meta: SgmvMetadata) -> SgmvFusedPlan | SgmvNativePlan | None:
    """The backend's per-step plan for one group: host work the Triton kernels do not need."""
    if backend is KernelBackend.NATIVE:
        return plan_sgmv_native(meta)
    if backend is KernelBackend.TORCH:
        return plan_sgmv_fused_torch(storage, meta)
    return None


def _merge_runs(runs: list[tuple[int, AdapterEntry | None]]) -> list[tuple[int, AdapterEntry | None]]:
    merged: list[tuple[int, AdapterEntry | None]] = []
    for num_tokens, entry in runs:
        if merged and merged[-1][1] is entry:
            merged[-1] = (merged[-1][0] + num_tokens, entry)
        else:
            merged.append((num_tokens, entry))
    return merged


def _append_rows(entry: AdapterEntry, modules: tuple[str, ...], row_addr: list[int]) -> dict[str, ModuleRows]:
    """Append the adapter's A and Bᵀ rows of ``modules`` to the group's row table; where each starts."""
    assert entry.row_addr is not None, f"adapter {entry.name} is not resident"
    addresses = entry.row_addr_list
    rows = {}
    for module in modules:
        if module not in entry.modules:
            continue
        a, b = entry.layout.group(module, "a"), entry.layout.group(module, "b")
        start_a = len(row_addr)
        row_addr.extend(addresses[a.first_row : a.first_row + a.num_rows])
        start_b = len(row_addr)
        row_addr.extend(addresses[b.first_row : b.first_row + b.num_rows])
        rows[module] = ModuleRows(start_a, start_b, a.num_rows)
    return rows
