"""The fused shrink + expand (the engine's LoRA op) against the float64 reference of shrink then expand,
on the same cases as the separate ops: mixed ranks, popularities, odd widths, packed rows, half precision."""

import dataclasses
import random

import pytest
import torch

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.sgmv.lora_metadata import build_sgmv_metadata
from loraplex_kernels.sgmv.sgmv_expand import expand_partials
from loraplex_kernels.sgmv.sgmv_fused import sgmv_fused
from loraplex_kernels.sgmv.sgmv_fused_torch import MAX_DENSE_ITEMS, plan_sgmv_fused_torch, sgmv_fused_torch
from loraplex_kernels.sgmv.sgmv_shrink import shrink_partials
from loraplex_kernels.sgmv.sgmv_torch_plan import MAX_SHORT_LEN
from tests.kernels.test_sgmv import (
    GROUPS,
    LAYER,
    NUM_LAYERS,
    PAGE_SIZE,
    POPULARITY,
    Case,
    assert_close,
    blocks,
    make_case,
    reference_shrink,
    written,
)


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, shown when a comparison fails so the case can be replayed."""
    return random.randrange(2**31)


def reference_fused(case: Case, layer: int) -> torch.Tensor:
    """y + (x @ Aᵀ) @ Bᵀ per (segment, module) in float64: [num_tokens, y_width]."""
    v = reference_shrink(case, layer)  # [num_tokens, v_width]
    y = case.y.double()  # [num_tokens, y_width]
    for rows, m, cols, adapter in blocks(case):
        out = slice(case.meta.out_offsets[m], case.meta.out_offsets[m] + case.meta.out_dims[m])
        y[rows, out] += v[rows, cols] @ adapter.bt[m][layer].double()  # [rows, out_dim]
    return y


def check_fused(case: Case, seed: int, tol: float = 1e-4, layer: int = LAYER) -> None:
    """Planned and unplanned, the dispatcher and the torch implementation: y as the reference, and
    nothing outside the (segment, module) blocks touched."""
    _, y_mask = written(case)
    expected = reference_fused(case, layer)
    plan = plan_sgmv_fused_torch(case.storage, case.meta)
    for run in (
        lambda y: sgmv_fused(case.x, case.storage, case.meta, layer * PAGE_SIZE, y, plan),
        lambda y: sgmv_fused_torch(case.x, case.storage, case.meta, layer * PAGE_SIZE, y),
    ):
        y = case.y.clone()
        run(y)
        assert_close(y.double(), expected, tol, seed)
        assert torch.equal(y[~y_mask], case.y[~y_mask]), f"touched rows it does not own, seed={seed}"


@pytest.mark.parametrize("in_per_split", [None, 16, 20])
@pytest.mark.parametrize("group", list(GROUPS))
def test_triton_shrink_partials_into_expand_match_float64_reference(group: str, in_per_split: int | None, seed: int):
    """The Triton backend's fused op: the shrink's fp32 partial sums (left uninitialised where no program
    writes) read by the expand, in one slice (the dispatcher) and in several."""
    case = make_case(group, [7, 16, 64], "skewed", num_tokens=40, dtype=torch.float32, seed=seed)
    _, y_mask = written(case)
    layer_offset = LAYER * PAGE_SIZE
    y = case.y.clone()
    if in_per_split is None:
        sgmv_fused(case.x, case.storage, case.meta, layer_offset, y, backend=KernelBackend.TRITON)
    else:
        partials = shrink_partials(case.x, case.storage, case.meta, layer_offset, in_per_split, zeroed=False)
        partials[:, ~written(case)[0]] = float("nan")  # what no program writes must never be read
        expand_partials(partials, case.storage, case.meta, layer_offset, y)
    assert_close(y.double(), reference_fused(case, LAYER), 1e-4, seed)
    assert torch.equal(y[~y_mask], case.y[~y_mask]), f"touched rows it does not own, seed={seed}"


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("group", list(GROUPS))
def test_mixed_ranks_match_float64_reference(group: str, popularity: str, seed: int):
    case = make_case(group, [1, 7, 16, 64], popularity, num_tokens=37, dtype=torch.float32, seed=seed)
    plan = plan_sgmv_fused_torch(case.storage, case.meta)
    used = {adapter for adapter in case.segment_adapters if adapter is not None}
    if plan.separate is None:
        assert plan.long and (plan.dense_tokens or plan.dense_rows is not None)  # long alone, short together
        ranks = {a: sum(t.shape[1] for t in case.adapters[a].a if t is not None) for a in used}
        assert plan.num_cols == sum(ranks.values())  # each adapter's rows gathered once, however many segments
    check_fused(case, seed)


@pytest.mark.parametrize("rank", [1, 7, 16, 64])
@pytest.mark.parametrize("num_tokens", [1, 13, 2 * MAX_SHORT_LEN + 7])
def test_each_rank_matches_float64_reference(rank: int, num_tokens: int, seed: int):
    check_fused(make_case("odd", [rank], "uniform", num_tokens, torch.float32, seed), seed)


def test_every_layer_and_prime_batch_sizes(seed: int):
    for num_tokens in (2, 3, 5, 17, 41, 53):
        case = make_case("qkv", [1, 7, 16, 64], "skewed", num_tokens, torch.float32, seed + num_tokens)
        for layer in range(NUM_LAYERS):
            check_fused(case, seed + num_tokens, layer=layer)


@pytest.mark.parametrize("long_in_the_middle", [False, True])
def test_short_segments_spanned_or_gathered(long_in_the_middle: bool, seed: int):
    """Short segments on both sides of a long one are gathered (the span would be mostly the long one's
    rows); all at one end are read through a view."""
    case = make_case("qkv", [7, 16], "uniform", num_tokens=2 * MAX_SHORT_LEN + 9, dtype=torch.float32, seed=seed)
    # the long segment last, the one without adapter just before it: order[0] reads an adapter
    order = sorted(
        range(len(case.segments)), key=lambda s: (case.segments[s][0] > MAX_SHORT_LEN, case.segments[s][1] is None)
    )
    if long_in_the_middle:
        order = [order[0], order[-1], *order[1:-1]]
    segments = tuple(case.segments[s] for s in order)
    case = dataclasses.replace(
        case,
        meta=build_sgmv_metadata(segments, case.row_addr, case.meta.in_dim, case.meta.out_dims),
        segments=segments,
        segment_adapters=tuple(case.segment_adapters[s] for s in order),
    )
    plan = plan_sgmv_fused_torch(case.storage, case.meta)
    assert (plan.dense_rows is not None) == long_in_the_middle
    assert (plan.dense_tokens is not None) == (not long_in_the_middle)
    check_fused(case, seed)


def test_many_adapters_in_short_segments_take_the_separate_ops(seed: int):
    case = make_case("qkv", [1, 7, 16], "distinct", num_tokens=10 * MAX_DENSE_ITEMS, dtype=torch.float32, seed=seed)
    assert len(case.segments) > MAX_DENSE_ITEMS + 2  # distinct adapters; a long segment and one without
    plan = plan_sgmv_fused_torch(case.storage, case.meta)
    assert plan.separate is not None and plan.num_cols == 0
    check_fused(case, seed)
    other = build_sgmv_metadata(case.segments, case.row_addr, case.meta.in_dim, case.meta.out_dims)
    with pytest.raises(ValueError, match="another SgmvMetadata"):  # the separate ops check the plan
        sgmv_fused(
            case.x,
            case.storage,
            case.meta,
            LAYER * PAGE_SIZE,
            case.y.clone(),
            plan_sgmv_fused_torch(case.storage, other),
        )


def test_one_adapter_everywhere_needs_no_mask(seed: int):
    """Every token of the short segments reads the same single adapter: no column to mask out."""
    case = make_case("qkv", [16], "identical", num_tokens=9, dtype=torch.float32, seed=seed)
    segments = [(length, spec) for length, spec in case.segments if spec is not None]
    meta = build_sgmv_metadata(segments, case.row_addr, case.meta.in_dim, case.meta.out_dims)
    plan = plan_sgmv_fused_torch(case.storage, meta)
    assert plan.dense_mask is None and not plan.long
    num_tokens = meta.num_tokens
    y = case.y[:num_tokens].clone()
    sgmv_fused(case.x[:num_tokens].contiguous(), case.storage, meta, LAYER * PAGE_SIZE, y, plan)
    a, bt = case.adapters[0].a, case.adapters[0].bt
    expected = case.y[:num_tokens].double()
    for m in (0, 2):  # adapter 0 lacks its second module
        cols = slice(meta.out_offsets[m], meta.out_offsets[m] + meta.out_dims[m])
        expected[:, cols] += case.x[:num_tokens].double() @ a[m][LAYER].double().T @ bt[m][LAYER].double()
    assert_close(y.double(), expected, 1e-4, seed)


def test_rows_packed_from_page_start_take_the_chunked_gather(seed: int):
    case = make_case("single", [16, 32], "skewed", num_tokens=41, dtype=torch.float32, seed=seed, packed=True)
    assert plan_sgmv_fused_torch(case.storage, case.meta).chunk == 16
    check_fused(case, seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_close_to_reference(dtype: torch.dtype, seed: int):
    case = make_case("qkv", [7, 16], "uniform", num_tokens=19, dtype=dtype, seed=seed)
    check_fused(case, seed, tol=2e-2)


def test_no_adapter_and_empty_segments_leave_y_untouched(seed: int):
    gen = torch.Generator().manual_seed(seed)
    meta = build_sgmv_metadata([(3, None), (0, [(0, 1, 1), None]), (2, [None, None])], [0, 40], 33, (33, 64))
    storage = torch.randn(2, NUM_LAYERS, PAGE_SIZE, generator=gen)  # [2, layers, P]
    x = torch.randn(5, 33, generator=gen)  # [5, 33]
    y = torch.randn(5, 97, generator=gen)  # [5, 97]
    before = y.clone()
    sgmv_fused(x, storage, meta, PAGE_SIZE, y)
    assert torch.equal(y, before)


def test_rejects_bad_inputs_and_another_steps_plan(seed: int):
    case = make_case("qkv", [7], "identical", num_tokens=5, dtype=torch.float32, seed=seed)
    x, storage, meta, y = case.x, case.storage, case.meta, case.y
    offset = LAYER * PAGE_SIZE
    with pytest.raises(ValueError, match="storage is"):
        sgmv_fused(x, storage.half(), meta, offset, y)
    with pytest.raises(ValueError, match="y_width"):
        sgmv_fused(x, storage, meta, offset, y[:, :-1].contiguous())
    with pytest.raises(ValueError, match="y is"):
        sgmv_fused(x, storage, meta, offset, y.half())
    with pytest.raises(ValueError, match="past the pool"):
        sgmv_fused(x, storage, meta, storage.numel(), y)
    other = build_sgmv_metadata(case.segments, case.row_addr, meta.in_dim, meta.out_dims)
    with pytest.raises(ValueError, match="another SgmvMetadata"):
        sgmv_fused(x, storage, meta, offset, y, plan_sgmv_fused_torch(storage, other))
