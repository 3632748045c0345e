"""The tiled prefill attention kernel under the interpreter against a float64 reference, alone and through
``paged_attention_triton``, which routes segments of MIN_TILED_ROWS rows or more to it and the other rows
to the row kernel.

The interpreter is ~3000x slower than a GPU, so the shapes are tiny: two or three chunks of 16-40 rows,
head_dim 16 and 24 (padded to 32), pages of 4 and 16 tokens, groups of 1 and 3. The interpreter's bfloat16
``tl.dot`` multiplies values here, not bit patterns (tests/triton_bf16_dot.py).
"""

import itertools
import random

import pytest
import torch

import loraplex_kernels.attention.paged_attention_triton as paged_attention_module
from loraplex_kernels.attention.paged_attention_triton import paged_attention_triton
from loraplex_kernels.attention.paged_prefill_attention import (
    MIN_TILED_ROWS,
    paged_prefill_attention_triton,
    plan_prefill_tiles,
    tokens_per_tile,
)
from tests.kernels.test_paged_attention import Batch, assert_close, make_batch, reference

# (q_len, seq_len) per sequence, chunks of 16-40 rows: one exactly MIN_TILED_ROWS long from scratch, two
# starting mid-context (their keys before the chunk come from earlier pages).
LONG = [(16, 16), (40, 57), (17, 30)]
# Decode rows first (as the metadata builder orders them), short chunks between the long ones.
MIXED = [(1, 1), (1, 18), (1, 33), (15, 15), (21, 21), (3, 11), (34, 50)]
HEADS = [(2, 1), (2, 3)]  # (num_kv_heads, group)
SENTINEL = 7.0  # written by a stand-in for the tiled kernel, never an attention output of these inputs


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, shown when a comparison fails so the case can be replayed."""
    return random.randrange(2**31)


def long_rows(batch: Batch) -> torch.Tensor:
    """[num_tokens] bool: the rows of segments of at least MIN_TILED_ROWS rows."""
    starts = batch.meta.query_start_loc_list
    mask = torch.zeros(batch.meta.num_tokens, dtype=torch.bool)  # [num_tokens]
    for start, end in itertools.pairwise(starts):
        mask[start:end] = end - start >= MIN_TILED_ROWS
    return mask


def run_tiled(batch: Batch) -> torch.Tensor:
    """The tiled kernel alone, into an output filled with NaN."""
    group = batch.q.shape[1] // batch.kv_cache.shape[3]
    out = torch.full_like(batch.q, float("nan"))  # [num_tokens, num_heads, head_dim]
    tiles = plan_prefill_tiles(batch.meta.query_start_loc_list, group, batch.q.device)  # [num_tiles, 2]
    paged_prefill_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale, out, tiles)
    return out


@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize(("num_kv_heads", "group"), HEADS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_tiled_kernel_matches_float64_reference(
    block_size: int, num_kv_heads: int, group: int, head_dim: int, seed: int
):
    batch = make_batch(LONG, num_kv_heads, group, head_dim, torch.float32, seed, block_size=block_size)

    out = run_tiled(batch)

    assert_close(out.double(), reference(batch), tol=1e-4, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_tiled_kernel_16_bit_close_to_reference(dtype: torch.dtype, seed: int):
    batch = make_batch(LONG, 2, 3, 24, dtype, seed, block_size=4)

    out = run_tiled(batch)

    assert out.dtype == dtype
    assert_close(out.double(), reference(batch), tol=2e-2, seed=seed)


def test_tiled_kernel_writes_only_rows_of_long_segments(seed: int):
    batch = make_batch(MIXED, 2, 3, 16, torch.float32, seed, block_size=4)
    long = long_rows(batch)

    out = run_tiled(batch)

    assert out[~long].isnan().all()
    assert_close(out[long].double(), reference(batch)[long], tol=1e-4, seed=seed)


@pytest.mark.parametrize("group", [1, 3, 7])
def test_tiles_cover_each_row_of_a_long_segment_once(group: int):
    query_start_loc = (0, 1, 2, 17, 20, 60, 60, 76)  # segments of 1, 1, 15, 3, 40, 0 and 16 rows
    step = tokens_per_tile(group)

    tiles = plan_prefill_tiles(query_start_loc, group, torch.device("cpu"))

    assert tiles.dtype == torch.int32 and tiles.shape[1] == 2
    covered = [
        row for first, seq in tiles.tolist() for row in range(first, min(first + step, query_start_loc[seq + 1]))
    ]
    assert sorted(covered) == list(range(20, 60)) + list(range(60, 76))
    assert all(query_start_loc[seq] <= first < query_start_loc[seq + 1] for first, seq in tiles.tolist())


@pytest.mark.parametrize(("num_kv_heads", "group"), HEADS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_launcher_mixes_decode_rows_and_long_chunks(block_size: int, num_kv_heads: int, group: int, seed: int):
    batch = make_batch(MIXED, num_kv_heads, group, 24, torch.float32, seed, block_size=block_size)

    out = paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale)

    assert_close(out.double(), reference(batch), tol=1e-4, seed=seed)


def test_launcher_routes_long_segments_to_the_tiled_kernel_only(monkeypatch: pytest.MonkeyPatch, seed: int):
    """A stand-in for the tiled kernel writes SENTINEL into the rows its tiles cover: exactly the long
    segments' rows end up SENTINEL (the row kernel left them alone), the others are attention."""
    batch = make_batch(MIXED, 2, 3, 16, torch.float32, seed, block_size=4)
    step = tokens_per_tile(3)
    calls = []

    def tiled_stand_in(q, kv_cache, meta, scale, out, tiles):
        calls.append(tiles)
        for first, seq in tiles.tolist():
            out[first : min(first + step, meta.query_start_loc_list[seq + 1])] = SENTINEL

    monkeypatch.setattr(paged_attention_module, "paged_prefill_attention_triton", tiled_stand_in)

    out = paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale)

    long = long_rows(batch)
    assert len(calls) == 1
    assert (out[long] == SENTINEL).all()
    assert_close(out[~long].double(), reference(batch)[~long], tol=1e-4, seed=seed)


def test_launcher_skips_the_tiled_kernel_without_a_long_segment(monkeypatch: pytest.MonkeyPatch, seed: int):
    batch = make_batch([(1, 5), (15, 20), (2, 2)], 1, 3, 16, torch.float32, seed, block_size=4)

    def must_not_run(*args: object) -> None:
        pytest.fail("the tiled kernel was launched for a batch without a segment of MIN_TILED_ROWS rows")

    monkeypatch.setattr(paged_attention_module, "paged_prefill_attention_triton", must_not_run)

    out = paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale)

    assert_close(out.double(), reference(batch), tol=1e-4, seed=seed)
