"""The native fused shrink + expand against the float64 reference and the torch implementation: mixed ranks,
popularities, odd widths, every layer, one adapter's tokens scattered through the step, bad inputs; and the
same on a bf16 pool (bf16 mode's), whose rows the op widens to fp32 as it reads them.

Tolerances: 1e-4 against float64 on fp32 pools (summation order). On a bf16 pool the reference is computed on
the same bf16 values (exact in float64); widening is exact, so the op meets the same 1e-4 and gives the very
bits it gives on a float32 pool holding those values.

Run under LORAPLEX_NATIVE_MARCH=haswell too (tests/kernels/test_avx2_build.py), to test the AVX2 paths.
"""

import dataclasses
import random

import pytest
import torch

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.sgmv.lora_metadata import build_sgmv_metadata
from loraplex_kernels.sgmv.sgmv_fused import sgmv_fused
from loraplex_kernels.sgmv.sgmv_fused_native import plan_sgmv_native, sgmv_fused_native
from loraplex_kernels.sgmv.sgmv_fused_torch import plan_sgmv_fused_torch
from tests.kernels.test_sgmv import (
    GROUPS,
    LAYER,
    NUM_LAYERS,
    PAGE_SIZE,
    POPULARITY,
    Case,
    assert_close,
    make_case,
    written,
)
from tests.kernels.test_sgmv_fused import reference_fused

pytestmark = pytest.mark.usefixtures("native")

# More tokens than one of the op's tiles (16), so an item's tokens span several work items.
LONG_TOKENS = 41


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, shown when a comparison fails so the case can be replayed."""
    return random.randrange(2**31)


def check_native(case: Case, seed: int, layer: int = LAYER, same_bits_as: torch.Tensor | None = None) -> None:
    """Planned, unplanned and through the dispatcher: y as the reference, nothing outside the blocks touched, and
    y bit for bit ``same_bits_as`` when given."""
    _, y_mask = written(case)
    expected = reference_fused(case, layer)  # [num_tokens, y_width] float64
    plan = plan_sgmv_native(case.meta)
    for run in (
        lambda y: sgmv_fused(case.x, case.storage, case.meta, layer * PAGE_SIZE, y, plan, KernelBackend.NATIVE),
        lambda y: sgmv_fused_native(case.x, case.storage, case.meta, layer * PAGE_SIZE, y),
    ):
        y = case.y.clone()
        run(y)
        assert_close(y.double(), expected, 1e-4, seed)
        if same_bits_as is not None:
            assert torch.equal(y, same_bits_as), f"bf16 rows read differently from their fp32 values, seed={seed}"
        assert torch.equal(y[~y_mask], case.y[~y_mask]), f"touched rows it does not own, seed={seed}"


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("group", list(GROUPS))
def test_mixed_ranks_match_float64_reference(group: str, popularity: str, seed: int):
    case = make_case(group, [1, 7, 16, 64], popularity, num_tokens=37, dtype=torch.float32, seed=seed)
    check_native(case, seed)


@pytest.mark.parametrize("rank", [1, 7, 16, 64])
@pytest.mark.parametrize("num_tokens", [1, 13, LONG_TOKENS])
def test_each_rank_matches_float64_reference(rank: int, num_tokens: int, seed: int):
    check_native(make_case("odd", [rank], "uniform", num_tokens, torch.float32, seed), seed)


def test_every_layer_and_prime_batch_sizes(seed: int):
    for num_tokens in (2, 3, 5, 17, 41, 53):
        case = make_case("qkv", [1, 7, 16, 64], "skewed", num_tokens, torch.float32, seed + num_tokens)
        for layer in range(NUM_LAYERS):
            check_native(case, seed + num_tokens, layer=layer)


def test_one_adapters_scattered_tokens_make_one_item(seed: int):
    """Decode tokens of two adapters alternating, base-model tokens between: two items, each reading its rows
    once for all of its tokens, and the same y as the torch implementation."""
    case = make_case("qkv", [7, 16], "uniform", num_tokens=LONG_TOKENS, dtype=torch.float32, seed=seed)
    specs = {adapter: spec for (_, spec), adapter in zip(case.segments, case.segment_adapters, strict=True)}
    first, second = sorted(adapter for adapter in specs if adapter is not None)[:2]
    pattern = [first, second, None, second, first, first, None, second] * 5 + [first]  # 41 one-token segments
    segments = [(1, specs[adapter] if adapter is not None else None) for adapter in pattern]
    meta = build_sgmv_metadata(segments, case.row_addr, case.meta.in_dim, case.meta.out_dims)
    plan = plan_sgmv_native(meta)
    assert plan.item_starts.tolist() == [0, pattern.count(first), pattern.count(first) + pattern.count(second)]
    assert plan.token_ids[: pattern.count(first)].tolist() == [t for t, a in enumerate(pattern) if a == first]
    expected = case.y.clone()
    sgmv_fused(case.x, case.storage, meta, LAYER * PAGE_SIZE, expected, plan_sgmv_fused_torch(case.storage, meta))
    y = case.y.clone()
    sgmv_fused_native(case.x, case.storage, meta, LAYER * PAGE_SIZE, y, plan)
    assert_close(y.double(), expected.double(), 1e-4, seed)
    base_rows = [t for t, adapter in enumerate(pattern) if adapter is None]
    assert torch.equal(y[base_rows], case.y[base_rows])


def test_no_adapter_and_empty_segments_leave_y_untouched(seed: int):
    gen = torch.Generator().manual_seed(seed)
    meta = build_sgmv_metadata([(3, None), (0, [(0, 1, 1), None]), (2, [None, None])], [0, 40], 33, (33, 64))
    storage = torch.randn(2, NUM_LAYERS, PAGE_SIZE, generator=gen)  # [2, layers, P]
    x = torch.randn(5, 33, generator=gen)  # [5, 33]
    y = torch.randn(5, 97, generator=gen)  # [5, 97]
    before = y.clone()
    sgmv_fused_native(x, storage, meta, PAGE_SIZE, y)
    assert torch.equal(y, before)


def test_rejects_bad_inputs_and_another_steps_plan(seed: int):
    case = make_case("qkv", [7], "identical", num_tokens=5, dtype=torch.float32, seed=seed)
    x, storage, meta, y = case.x, case.storage, case.meta, case.y
    offset = LAYER * PAGE_SIZE
    with pytest.raises(ValueError, match="past the pool"):
        sgmv_fused_native(x, storage, meta, storage.numel() - PAGE_SIZE, y)
    with pytest.raises(ValueError, match="float32"):
        sgmv_fused_native(x.double(), storage, meta, offset, y)
    with pytest.raises(ValueError, match="outside y"):
        sgmv_fused_native(x, storage, meta, offset, y[:, :-1])
    other = build_sgmv_metadata(case.segments, case.row_addr, meta.in_dim, meta.out_dims)
    with pytest.raises(ValueError, match="other metadata"):
        sgmv_fused_native(x, storage, meta, offset, y, plan_sgmv_native(other))
    with pytest.raises(ValueError, match="plan_sgmv_native"):
        sgmv_fused(x, storage, meta, offset, y, plan_sgmv_fused_torch(storage, meta), KernelBackend.NATIVE)


def bf16_case(group: str, ranks: list[int], popularity: str, num_tokens: int, seed: int) -> Case:
    """A case whose pool (adapter rows and the noise around them) is bf16, beside float32 x, v and y."""
    case = make_case(group, ranks, popularity, num_tokens, torch.bfloat16, seed)
    return dataclasses.replace(case, x=case.x.float(), v=case.v.float(), y=case.y.float())


def check_bf16_pool(case: Case, seed: int, layer: int = LAYER) -> None:
    """On the bf16 pool: y as the reference on the bf16 values, the same bits as on a float32 pool holding them,
    nothing outside the blocks touched."""
    assert case.storage.dtype == torch.bfloat16 and case.x.dtype == torch.float32
    on_fp32 = case.y.clone()
    sgmv_fused_native(case.x, case.storage.float(), case.meta, layer * PAGE_SIZE, on_fp32)
    check_native(case, seed, layer, same_bits_as=on_fp32)


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("group", list(GROUPS))
def test_bf16_pool_mixed_ranks_match_reference(group: str, popularity: str, seed: int):
    check_bf16_pool(bf16_case(group, [1, 7, 16, 64], popularity, num_tokens=37, seed=seed), seed)


@pytest.mark.parametrize("rank", [1, 7, 16, 64])
@pytest.mark.parametrize("num_tokens", [1, 13, LONG_TOKENS])
def test_bf16_pool_each_rank_matches_reference(rank: int, num_tokens: int, seed: int):
    check_bf16_pool(bf16_case("odd", [rank], "uniform", num_tokens, seed), seed)


def test_bf16_pool_every_layer_and_prime_batch_sizes(seed: int):
    for num_tokens in (2, 3, 5, 17, 41, 53):
        case = bf16_case("qkv", [1, 7, 16, 64], "skewed", num_tokens, seed + num_tokens)
        for layer in range(NUM_LAYERS):
            check_bf16_pool(case, seed + num_tokens, layer=layer)


def test_bf16_pool_rejects_other_pools_and_reads_within_its_own(seed: int):
    """Row addresses count the pool's own elements: the bound check is in bf16 elements, and a float16 pool
    (or a bf16 x beside it) is refused with what to pass."""
    case = bf16_case("qkv", [7], "identical", num_tokens=5, seed=seed)
    x, storage, meta, y = case.x, case.storage, case.meta, case.y
    with pytest.raises(ValueError, match="past the pool"):
        sgmv_fused_native(x, storage, meta, storage.numel() - PAGE_SIZE, y)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        sgmv_fused(x, storage.half(), meta, LAYER * PAGE_SIZE, y, backend=KernelBackend.NATIVE)
    with pytest.raises(ValueError, match="float32 or bfloat16 page pool"):
        sgmv_fused_native(x, storage.half(), meta, LAYER * PAGE_SIZE, y)
    with pytest.raises(ValueError, match="x must be a float32"):
        sgmv_fused_native(x.bfloat16(), storage, meta, LAYER * PAGE_SIZE, y)
