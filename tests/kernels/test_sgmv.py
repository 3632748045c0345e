"""SGMV shrink and expand: the Triton kernels (under the interpreter) and the torch implementation against
a float64 reference computed from each adapter's dense A and Bᵀ, with the rows scattered over a pool."""

import dataclasses
import math
import random

import pytest
import torch

from loraplex_kernels.sgmv.lora_metadata import (
    ModuleRows,
    SegmentSpec,
    SgmvMetadata,
    build_sgmv_metadata,
    with_segment_tokens,
)
from loraplex_kernels.sgmv.sgmv_expand import expand_grid, sgmv_expand, sgmv_expand_triton
from loraplex_kernels.sgmv.sgmv_shrink import sgmv_shrink, sgmv_shrink_triton, shrink_grid, shrink_partials
from loraplex_kernels.sgmv.sgmv_torch import sgmv_expand_torch, sgmv_shrink_torch
from loraplex_kernels.sgmv.sgmv_torch_plan import MAX_SHORT_LEN, plan_sgmv_torch

NUM_LAYERS = 3
LAYER = 2  # not 0, so a missing or wrong layer offset reads another layer's rows
PAGE_SIZE = 160  # P: holds two rows of 64 and some gap; not a multiple of 48 or 33
SPARE_PAGES = 3  # pages owned by no adapter, full of noise like every gap between rows

# (in_dim, out_dims): a q/k/v-like group, a gate/up-like group with odd widths, a single module.
GROUPS = {"qkv": (48, (48, 16, 16)), "odd": (33, (33, 64)), "single": (64, (48,))}
POPULARITY = ["distinct", "uniform", "skewed", "identical"]
# (tokens, adapter or None for the base model) around the kernels' 16-token tile: one token, one short of a
# tile, exactly one, one past, two and a half tiles, an empty segment; base-model segments between them,
# one longer than a tile.
TILED_SEGMENTS = [(17, 0), (0, 1), (3, None), (1, 1), (40, 2), (20, None), (15, 0), (16, 1), (1, None)]
MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z extents


@dataclasses.dataclass(frozen=True)
class Adapter:
    a: tuple[torch.Tensor | None, ...]  # per module [NUM_LAYERS, rank, in_dim], None: module not targeted
    bt: tuple[torch.Tensor | None, ...]  # per module [NUM_LAYERS, rank, out_dim]


@dataclasses.dataclass(frozen=True)
class Case:
    storage: torch.Tensor  # [num_pages, NUM_LAYERS, PAGE_SIZE]
    meta: SgmvMetadata
    adapters: tuple[Adapter, ...]
    segment_adapters: tuple[int | None, ...]  # per segment, None: the base model only
    segments: tuple[SegmentSpec, ...]  # what build_sgmv_metadata was given, to rebuild variants
    row_addr: tuple[int, ...]
    x: torch.Tensor  # [num_tokens, in_dim]
    v: torch.Tensor  # [num_tokens, v_width], an expand input independent of the shrink
    y: torch.Tensor  # [num_tokens, y_width], what expand adds to


def split_tokens(num_tokens: int, rng: random.Random) -> list[int]:
    """Segment lengths: decode-like 1s and short runs, plus (from 2 * MAX_SHORT_LEN tokens on) a 3-token
    segment and one segment too long to count as short."""
    lengths = []
    left = num_tokens
    if num_tokens > 2 * MAX_SHORT_LEN:
        lengths += [MAX_SHORT_LEN + 1 + rng.randrange(4), 3]
        left -= sum(lengths)
    while left:
        lengths.append(min(left, rng.choice([1, 1, 1, 2, 3, 5])))
        left -= lengths[-1]
    rng.shuffle(lengths)
    return lengths


def assign_adapters(lengths: list[int], popularity: str, rng: random.Random) -> list[int | None]:
    """An adapter per segment, by popularity; one segment of a single token if any, else one short segment,
    has none (when there are two segments or more)."""
    num_segments = len(lengths)
    ones = [s for s, length in enumerate(lengths) if length == 1]
    bare = rng.choice(ones or [s for s, length in enumerate(lengths) if length <= MAX_SHORT_LEN])
    bare = bare if num_segments > 1 else -1
    with_adapter = num_segments - (bare >= 0)
    if popularity == "distinct":
        choices = list(range(with_adapter))
    elif popularity == "uniform":
        choices = [rng.randrange(4) for _ in range(with_adapter)]
    elif popularity == "skewed":
        choices = rng.choices(range(6), weights=[1 / (i + 1) ** 2 for i in range(6)], k=with_adapter)
    else:
        choices = [0] * with_adapter
    it = iter(choices)
    return [None if s == bare else next(it) for s in range(num_segments)]


def make_case(
    group: str,
    ranks: list[int],
    popularity: str,
    num_tokens: int,
    dtype: torch.dtype,
    seed: int,
    packed: bool = False,
) -> Case:
    """Random adapters placed at random pages and offsets of a noisy pool, and random segments over them.

    Adapter 0 lacks its second module when the group has two or more. ``packed`` places rows back to back
    from each page's start (as an engine would) instead of leaving random gaps between them.
    """
    rng = random.Random(seed)
    lengths = split_tokens(num_tokens, rng)
    return case_of_segments(group, ranks, lengths, assign_adapters(lengths, popularity, rng), dtype, seed, packed)


def case_of_segments(
    group: str,
    ranks: list[int],
    lengths: list[int],
    segment_adapters: list[int | None],
    dtype: torch.dtype,
    seed: int,
    packed: bool = False,
) -> Case:
    """``make_case`` for given segments: ``lengths[s]`` tokens reading adapter ``segment_adapters[s]``
    (None: the base model only)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed + 1)
    in_dim, out_dims = GROUPS[group]
    num_tokens = sum(lengths)
    used = sorted({a for a in segment_adapters if a is not None})
    num_adapters = max(used, default=-1) + 1

    adapters = []
    for index in range(num_adapters):
        rank = rng.choice(ranks)
        a, bt = [], []
        for m, out_dim in enumerate(out_dims):
            if index == 0 and m == 1:
                a.append(None)
                bt.append(None)
                continue
            a.append(torch.randn(NUM_LAYERS, rank, in_dim, generator=gen).to(dtype) / math.sqrt(in_dim))
            bt.append(torch.randn(NUM_LAYERS, rank, out_dim, generator=gen).to(dtype) / math.sqrt(rank))
        adapters.append(Adapter(tuple(a), tuple(bt)))

    # Rows, adapter after adapter: each module's A rows then its Bᵀ rows. Each adapter owns whole pages.
    tensors_per_row = []
    num_rows = 0
    module_rows = []
    for adapter in adapters:
        rows = []
        for a, bt in zip(adapter.a, adapter.bt, strict=True):
            if a is None:
                rows.append(None)
                continue
            rank = a.shape[1]
            tensors_per_row.extend(a[:, j] for j in range(rank))  # [NUM_LAYERS, in_dim] each
            tensors_per_row.extend(bt[:, j] for j in range(rank))  # [NUM_LAYERS, out_dim] each
            rows.append(ModuleRows(num_rows, num_rows + rank, rank))
            num_rows += 2 * rank
        module_rows.append(rows)
        tensors_per_row.append(None)  # a page break: the next adapter starts on a fresh page

    num_pages = len(tensors_per_row) + SPARE_PAGES  # enough for one row per page
    free_pages = iter(torch.randperm(num_pages, generator=gen).tolist())
    storage = torch.randn(num_pages, NUM_LAYERS, PAGE_SIZE, generator=gen).to(dtype)  # noise everywhere
    flat = storage.view(-1)
    row_addr = []
    page, offset = next(free_pages), 0
    for tensor in tensors_per_row:
        if tensor is None:
            page, offset = next(free_pages), 0
            continue
        length = tensor.shape[1]
        offset += 0 if packed else rng.randrange(3)
        if offset + length > PAGE_SIZE:  # a row never straddles a page
            page, offset = next(free_pages), 0 if packed else rng.randrange(3)
        addr = page * NUM_LAYERS * PAGE_SIZE + offset
        for layer in range(NUM_LAYERS):
            flat[addr + layer * PAGE_SIZE : addr + layer * PAGE_SIZE + length] = tensor[layer]
        row_addr.append(addr)
        offset += length
    segments = [
        (length, None if adapter is None else module_rows[adapter])
        for length, adapter in zip(lengths, segment_adapters, strict=True)
    ]
    meta = build_sgmv_metadata(segments, row_addr, in_dim, out_dims)
    x = torch.randn(num_tokens, in_dim, generator=gen).to(dtype)  # [num_tokens, in_dim]
    v = torch.randn(num_tokens, meta.v_width, generator=gen).to(dtype)  # [num_tokens, v_width]
    y = torch.randn(num_tokens, meta.y_width, generator=gen).to(dtype)  # [num_tokens, y_width]
    return Case(storage, meta, tuple(adapters), tuple(segment_adapters), tuple(segments), tuple(row_addr), x, v, y)


def blocks(case: Case):
    """(token rows, module, v columns, adapter) of every (segment, module) pair that reads an adapter."""
    meta = case.meta
    for s, adapter in enumerate(case.segment_adapters):
        if adapter is None:
            continue
        rows = slice(meta.seg_starts_list[s], meta.seg_starts_list[s + 1])
        for m in range(meta.num_modules):
            rank = meta.ranks_list[s][m]
            if rank:
                cols = slice(meta.v_cols_list[s][m], meta.v_cols_list[s][m] + rank)
                yield rows, m, cols, case.adapters[adapter]


def reference_shrink(case: Case, layer: int) -> torch.Tensor:
    v = torch.zeros(case.meta.num_tokens, case.meta.v_width, dtype=torch.float64)  # [num_tokens, v_width]
    for rows, m, cols, adapter in blocks(case):
        v[rows, cols] = case.x[rows].double() @ adapter.a[m][layer].double().T  # [rows, rank]
    return v


def reference_expand(case: Case, layer: int) -> torch.Tensor:
    y = case.y.double()  # [num_tokens, y_width]
    for rows, m, cols, adapter in blocks(case):
        out = slice(case.meta.out_offsets[m], case.meta.out_offsets[m] + case.meta.out_dims[m])
        y[rows, out] += case.v[rows, cols].double() @ adapter.bt[m][layer].double()  # [rows, out_dim]
    return y


def written(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of the v elements shrink writes and the y elements expand adds to."""
    meta = case.meta
    v_mask = torch.zeros(meta.num_tokens, meta.v_width, dtype=torch.bool)  # [num_tokens, v_width]
    y_mask = torch.zeros(meta.num_tokens, meta.y_width, dtype=torch.bool)  # [num_tokens, y_width]
    for rows, m, cols, _ in blocks(case):
        v_mask[rows, cols] = True
        y_mask[rows, meta.out_offsets[m] : meta.out_offsets[m] + meta.out_dims[m]] = True
    return v_mask, y_mask


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, seed: int) -> None:
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, msg=lambda m: f"{m}\nseed={seed}")


def check_both_ops(case: Case, seed: int, tol: float = 1e-4) -> None:
    """Triton and torch shrink and expand against the float64 reference; what the ops do not own stays untouched."""
    layer_offset = LAYER * PAGE_SIZE
    v_mask, y_mask = written(case)
    expected_v = reference_shrink(case, LAYER)
    expected_y = reference_expand(case, LAYER)
    plan = plan_sgmv_torch(case.storage, case.meta)
    shrinks = {
        "triton": lambda: sgmv_shrink_triton(case.x, case.storage, case.meta, layer_offset),
        "torch": lambda: sgmv_shrink_torch(case.x, case.storage, case.meta, layer_offset, plan),
    }
    expands = {
        "triton": lambda y: sgmv_expand_triton(case.v, case.storage, case.meta, layer_offset, y),
        "torch": lambda y: sgmv_expand_torch(case.v, case.storage, case.meta, layer_offset, y, plan),
    }
    for name in ["triton", "torch"]:
        v = shrinks[name]()
        assert v.dtype == case.x.dtype and v.shape == expected_v.shape, name
        assert_close(v.double(), expected_v, tol, seed)
        assert not v[~v_mask].any(), f"{name} shrink wrote outside its rank blocks, seed={seed}"
        y = case.y.clone()
        expands[name](y)
        assert_close(y.double(), expected_y, tol, seed)
        assert torch.equal(y[~y_mask], case.y[~y_mask]), f"{name} expand touched rows it does not own, seed={seed}"


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, shown when a comparison fails so the case can be replayed."""
    return random.randrange(2**31)


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("group", list(GROUPS))
def test_mixed_ranks_match_float64_reference(group: str, popularity: str, seed: int):
    case = make_case(group, [1, 7, 16, 64], popularity, num_tokens=37, dtype=torch.float32, seed=seed)
    plan = plan_sgmv_torch(case.storage, case.meta)
    assert plan.expand and plan.bags is not None  # a long segment's products and the short ones' bags
    assert any(batch.pad_len > 1 for batch in plan.shrink)  # short segments padded to a common length
    used = {adapter for adapter in case.segment_adapters if adapter is not None}
    assert sum(batch.num_items for batch in plan.shrink) == len(used)  # one gather per adapter, not segment
    check_both_ops(case, seed)


@pytest.mark.parametrize("rank", [1, 7, 16, 64])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_each_rank_matches_float64_reference(rank: int, num_tokens: int, seed: int):
    case = make_case("odd", [rank], "uniform", num_tokens, torch.float32, seed)
    check_both_ops(case, seed)


def test_rows_packed_from_page_start_take_the_chunked_gather(seed: int):
    """Rows back to back from offset 0 with dims sharing a factor: the CPU gather copies pieces, not elements."""
    case = make_case("single", [16, 32], "skewed", num_tokens=41, dtype=torch.float32, seed=seed, packed=True)
    assert plan_sgmv_torch(case.storage, case.meta).chunk == 16
    check_both_ops(case, seed)


def test_float16_close_to_reference(seed: int):
    case = make_case("qkv", [7, 16], "uniform", num_tokens=19, dtype=torch.float16, seed=seed)
    check_both_ops(case, seed, tol=1e-2)


def test_bfloat16_close_to_reference(seed: int):
    """Through the Triton kernels too: the interpreter's bfloat16 tl.dot multiplies values here, not bit
    patterns (tests/triton_bf16_dot.py)."""
    case = make_case("qkv", [7, 16], "uniform", num_tokens=19, dtype=torch.bfloat16, seed=seed)
    check_both_ops(case, seed, tol=2e-2)


def test_one_plan_serves_every_layer_and_dispatch_is_the_torch_path(seed: int):
    case = make_case("qkv", [1, 7, 16, 64], "skewed", num_tokens=53, dtype=torch.float32, seed=seed)
    plan = plan_sgmv_torch(case.storage, case.meta)
    for layer in range(NUM_LAYERS):
        layer_offset = layer * PAGE_SIZE
        v = sgmv_shrink(case.x, case.storage, case.meta, layer_offset, plan)
        assert_close(v.double(), reference_shrink(case, layer), 1e-4, seed)
        assert torch.equal(v, sgmv_shrink_torch(case.x, case.storage, case.meta, layer_offset))  # unplanned
        y = case.y.clone()
        sgmv_expand(case.v, case.storage, case.meta, layer_offset, y, plan)
        assert_close(y.double(), reference_expand(case, layer), 1e-4, seed)


def test_empty_segments_change_nothing(seed: int):
    """Zero-token segments (with an adapter) around and between the others: the same v and y."""
    case = make_case("qkv", [7, 16], "uniform", num_tokens=13, dtype=torch.float32, seed=seed)
    with_adapter = next(spec for spec in case.segments if spec[1] is not None)
    segments = [(0, with_adapter[1]), *case.segments[:2], (0, with_adapter[1]), *case.segments[2:]]
    meta = build_sgmv_metadata(segments, case.row_addr, case.meta.in_dim, case.meta.out_dims)
    layer_offset = LAYER * PAGE_SIZE
    for shrink, expand in [(sgmv_shrink_triton, sgmv_expand_triton), (sgmv_shrink, sgmv_expand)]:
        v = shrink(case.x, case.storage, meta, layer_offset)
        assert_close(v.double(), reference_shrink(case, LAYER), 1e-4, seed)
        y = case.y.clone()
        expand(case.v, case.storage, meta, layer_offset, y)
        assert_close(y.double(), reference_expand(case, LAYER), 1e-4, seed)


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, 1e-4), (torch.float16, 1e-2), (torch.bfloat16, 2e-2)],
    ids=["float32", "float16", "bfloat16"],
)
def test_segments_longer_than_a_token_tile_match_float64_reference(dtype: torch.dtype, tol: float, seed: int):
    """Each token tile of a segment is a program of its own: every token of a segment of 15 to 40 tokens
    written once, beside one-token, empty and base-model segments."""
    lengths, adapters = zip(*TILED_SEGMENTS, strict=True)
    case = case_of_segments("qkv", [7, 16, 64], list(lengths), list(adapters), dtype, seed)
    # only segments with an adapter have tiles: 17, 1, 40, 15 and 16 tokens make 2 + 1 + 3 + 1 + 1
    assert shrink_grid(case.meta)[0] == expand_grid(case.meta)[0] == 8
    check_both_ops(case, seed, tol)


@pytest.mark.parametrize(("in_per_split", "num_splits"), [(16, {48: 3, 33: 3, 64: 4}), (20, {48: 3, 33: 2, 64: 4})])
@pytest.mark.parametrize("group", list(GROUPS))
def test_input_columns_in_slices_match_float64_reference(group: str, in_per_split: int, num_splits: dict, seed: int):
    """Split-K: the input columns cut into slices of near-equal width (48 into 16 + 16 + 16 or 3 × 16; 33 into
    11 × 3 or 17 + 16), a program per slice writing fp32 partial sums whose sum is v."""
    case = make_case(group, [7, 16, 64], "skewed", num_tokens=40, dtype=torch.float32, seed=seed)
    layer_offset = LAYER * PAGE_SIZE
    in_dim = case.meta.in_dim
    partials = shrink_partials(case.x, case.storage, case.meta, layer_offset, in_per_split)
    assert partials.shape == (num_splits[in_dim], case.meta.num_tokens, case.meta.v_width)
    rank_tiles = -(-case.meta.max_rank // 16)
    assert shrink_grid(case.meta, in_per_split)[2] == num_splits[in_dim] * rank_tiles
    v = sgmv_shrink_triton(case.x, case.storage, case.meta, layer_offset, in_per_split)
    assert_close(v.double(), reference_shrink(case, LAYER), 1e-4, seed)
    v_mask, _ = written(case)
    assert partials[:, v_mask].abs().sum(0).gt(0).all(), "every slice adds to every element of v it owns"


def test_recounted_segments_take_their_new_token_tiles(seed: int):
    """A step's tables recounted from one token a segment to longer ones (with_segment_tokens, as the engine
    keeps a step's tables when only its runs' lengths change): the kernels cover every token of the new
    lengths."""
    lengths, adapters = zip(*TILED_SEGMENTS, strict=True)
    case = case_of_segments("qkv", [7, 16], list(lengths), list(adapters), torch.float32, seed)
    one_each = [(1, spec) for _, spec in case.segments]
    meta = build_sgmv_metadata(one_each, case.row_addr, case.meta.in_dim, case.meta.out_dims)
    check_both_ops(dataclasses.replace(case, meta=with_segment_tokens(meta, lengths)), seed)


def test_grid_puts_a_long_segment_on_axis_0():
    """A segment of 2^20 tokens is 65,536 token tiles, more than a grid's y or z axis holds: they go on x
    beside the other segments' own tiles (one a decode token, none for a segment without rows); the other
    axes follow the model's shape."""
    in_dim, out_dims = 4096, (4096, 1024, 1024)
    rows = [ModuleRows(0, 64, 64)] * 3
    row_addr = [i * in_dim for i in range(128)]
    meta = build_sgmv_metadata([(2**20, rows), *[(1, rows)] * 300, (5, None)], row_addr, in_dim, out_dims)
    assert meta.tiles[:3].tolist() == [[0, 0], [0, 16], [0, 32]]
    assert meta.tiles[-1].tolist() == [300, 2**20 + 299]
    for grid in shrink_grid(meta), expand_grid(meta):
        assert grid[0] == 2**16 + 300
        assert max(grid[1:]) <= MAX_GRID_YZ


def test_a_plan_serves_only_its_own_metadata(seed: int):
    case = make_case("single", [7], "identical", num_tokens=5, dtype=torch.float32, seed=seed)
    other = build_sgmv_metadata(case.segments, case.row_addr, case.meta.in_dim, case.meta.out_dims)
    plan = plan_sgmv_torch(case.storage, other)
    with pytest.raises(ValueError, match="another SgmvMetadata"):
        sgmv_shrink(case.x, case.storage, case.meta, 0, plan)
    with pytest.raises(ValueError, match="another SgmvMetadata"):
        sgmv_expand(case.v, case.storage, case.meta, 0, case.y, plan)


def test_no_adapter_at_all_leaves_y_untouched_and_v_empty(seed: int):
    gen = torch.Generator().manual_seed(seed)
    meta = build_sgmv_metadata([(3, None), (2, [None, None])], [], 33, (33, 64))
    storage = torch.randn(2, NUM_LAYERS, PAGE_SIZE, generator=gen)  # [2, layers, P]
    x = torch.randn(5, 33, generator=gen)  # [5, 33]
    y = torch.randn(5, 97, generator=gen)  # [5, 97]
    before = y.clone()
    for shrink, expand in [(sgmv_shrink_triton, sgmv_expand_triton), (sgmv_shrink, sgmv_expand)]:
        v = shrink(x, storage, meta, PAGE_SIZE)
        assert v.shape == (5, 0)
        expand(v, storage, meta, PAGE_SIZE, y)
        assert torch.equal(y, before)


def test_metadata_lays_rank_blocks_side_by_side():
    meta = build_sgmv_metadata(
        [(2, [(0, 7, 7), None, (14, 30, 16)]), (1, None), (4, [(46, 47, 1), (48, 50, 2), (52, 54, 2)])],
        list(range(0, 56 * 100, 100)),
        in_dim=48,
        out_dims=(48, 16, 16),
    )
    assert meta.seg_starts_list == (0, 2, 3, 7)
    assert meta.v_cols_list == ((0, 7, 7), (0, 0, 0), (0, 1, 3))
    assert meta.ranks_list == ((7, 0, 16), (0, 0, 0), (1, 2, 2))
    assert meta.row_start_a_list[0] == (0, -1, 14)
    assert meta.v_width == 23  # the first segment's 7 + 16; nothing padded to a global maximum rank
    assert meta.max_rank == 16
    assert meta.out_offsets == (0, 48, 64) and meta.y_width == 80
    assert meta.max_row_end == 5500 + 16  # the last row read, 55 (a Bᵀ row of module 2), + its out_dim
    assert meta.ranks.dtype == torch.int32 and meta.ranks.shape == (3, 3)


def test_metadata_rejects_rows_outside_the_table():
    with pytest.raises(ValueError, match="outside the row table"):
        build_sgmv_metadata([(2, [(0, 4, 8)])], list(range(8)), 16, (16,))
    with pytest.raises(ValueError, match="lists 1 modules"):
        build_sgmv_metadata([(2, [(0, 4, 4)])], list(range(8)), 16, (16, 16))


def test_launchers_reject_bad_inputs(seed: int):
    case = make_case("qkv", [7], "identical", num_tokens=5, dtype=torch.float32, seed=seed)
    x, storage, meta, v, y = case.x, case.storage, case.meta, case.v, case.y
    offset = LAYER * PAGE_SIZE
    for shrink, expand in [(sgmv_shrink_triton, sgmv_expand_triton), (sgmv_shrink, sgmv_expand)]:
        with pytest.raises(ValueError, match="storage is"):
            shrink(x, storage.half(), meta, offset)
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            shrink(x.double(), storage, meta, offset)
        with pytest.raises(ValueError, match="in_dim"):
            shrink(x[:, :-1].contiguous(), storage, meta, offset)
        with pytest.raises(ValueError, match="contiguous"):
            shrink(x.t().contiguous().t(), storage, meta, offset)
        with pytest.raises(ValueError, match="past the pool"):
            shrink(x, storage, meta, storage.numel())
        with pytest.raises(ValueError, match="y_width"):
            expand(v, storage, meta, offset, y[:, :-1].contiguous())
        with pytest.raises(ValueError, match="v_width"):
            expand(v[:, :-1].contiguous(), storage, meta, offset, y)
        with pytest.raises(ValueError, match="v is"):
            expand(v.half(), storage, meta, offset, y)
    with pytest.raises(ValueError, match="int32"):
        sgmv_shrink_triton(x, storage, dataclasses.replace(meta, ranks=meta.ranks.long()), offset)


@pytest.mark.parametrize(
    ("row_addr", "out_dims", "row_align", "out_align"),
    [
        ([0, 64, 4096], (576, 192, 192), 16, 16),  # the engine's rows and SmolLM2's q/k/v
        ([32, 48, 40], (32, 16, 16), 8, 16),
        ([32, 48, 41], (33, 16, 16), 1, 1),
        ([6, 10], (20, 12, 12), 2, 4),
    ],
)
def test_alignments_divide_every_row_address_and_output_column(
    row_addr: list[int], out_dims: tuple[int, ...], row_align: int, out_align: int
):
    """What the kernels tell the compiler of the tables (tl.multiple_of): the largest powers of two up to 16 that
    divide every row address, and every output width and offset."""
    meta = build_sgmv_metadata([(1, [ModuleRows(0, 0, 1)] * 3)], row_addr, 64, out_dims)
    assert (meta.row_align, meta.out_align) == (row_align, out_align)
