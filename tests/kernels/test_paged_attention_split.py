"""The row kernel's split of long contexts into chunks of ``keys_per_split`` keys, under the interpreter.

``keys_per_split`` is 32 here (one key tile), so a context of about a hundred keys already takes several
chunks. Rows shorter than one chunk, exactly one chunk, and longer (a last chunk of one key, a position on a
chunk boundary, several chunks) against the float64 reference in fp32, fp16 and bf16; the same row gives the
same bits alone and beside rows of other lengths; the chunk axis of the grid comes from the host's lists.
"""

import dataclasses
import itertools
import random

import pytest
import torch

from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata
from loraplex_kernels.attention.paged_attention_split import KEYS_PER_SPLIT, max_row_splits, num_splits
from loraplex_kernels.attention.paged_attention_triton import paged_attention_triton
from loraplex_kernels.attention.paged_prefill_attention import MIN_TILED_ROWS
from tests.kernels.test_paged_attention import Batch, assert_close, make_batch, reference

KEYS = 32  # keys_per_split in these tests

# (q_len, seq_len) per sequence, decode rows first. Decode positions: 30 (shorter than a chunk), 31 (exactly
# one chunk), 32 (a second chunk of one key), 63 (two full chunks), 64 (a third chunk starting at the
# position), 99 (four chunks, the last of four keys). The chunks' rows straddle chunk boundaries: positions
# 29-33, 93-97 and 115-129 (15 rows: the row kernel's longest segment).
SPLIT_ROWS = [(1, 31), (1, 32), (1, 33), (1, 64), (1, 65), (1, 100), (5, 34), (5, 98), (15, 130)]
# A prefill chunk for the tiled kernel, with a context of several chunks: its rows are not the combine
# kernel's.
TILED = (MIN_TILED_ROWS + 4, 90)
HEADS = [(2, 1), (2, 3), (1, 8)]  # (num_kv_heads, group): group 3 is padded to 4 query heads
HEAD_DIMS = [64, 48]
# Both kernels accumulate in fp32 and round P to a 16-bit dtype before P·V: fp16 errs by that rounding and
# the output's, bf16 by its own.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, shown when a comparison fails so the case can be replayed."""
    return random.randrange(2**31)


def sub_batch(batch: Batch, seqs: list[int]) -> Batch:
    """The sequences ``seqs`` of ``batch`` (in that order) as a batch of their own, on the same pages."""
    meta = batch.meta
    bounds = list(itertools.pairwise(meta.query_start_loc_list))
    rows = [row for s in seqs for row in range(*bounds[s])]
    q_lens = [bounds[s][1] - bounds[s][0] for s in seqs]
    seq_lens = [meta.seq_lens_list[s] for s in seqs]
    query_start_loc = tuple(itertools.accumulate(q_lens, initial=0))
    sub_meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),  # [num_seqs + 1]
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [num_seqs]
        block_tables=meta.block_tables[seqs].contiguous(),  # [num_seqs, max_num_blocks]
        token_to_seq=torch.repeat_interleave(
            torch.arange(len(seqs), dtype=torch.int32), torch.tensor(q_lens), output_size=sum(q_lens)
        ),  # [num_tokens]
        num_decode_seqs=sum(1 for q_len in itertools.takewhile(lambda n: n == 1, q_lens)),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_list=query_start_loc,
        seq_lens_list=tuple(seq_lens),
    )
    return dataclasses.replace(batch, q=batch.q[rows].contiguous(), meta=sub_meta)  # q: [num_tokens, heads, d]


# Every head layout and head size in fp32; fp16 and bf16 (the same kernel, loads and stores of another width) on
# the padded group, one head size each: each case costs the interpreter seconds.
REFERENCE_CASES = [
    *((torch.float32, num_kv_heads, group, head_dim) for num_kv_heads, group in HEADS for head_dim in HEAD_DIMS),
    (torch.float16, 2, 3, 64),
    (torch.bfloat16, 2, 3, 48),
]


@pytest.mark.parametrize(("dtype", "num_kv_heads", "group", "head_dim"), REFERENCE_CASES, ids=str)
def test_split_rows_match_float64_reference(
    dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, seed: int
):
    batch = make_batch([*SPLIT_ROWS, TILED], num_kv_heads, group, head_dim, dtype, seed)
    assert max_row_splits(batch.meta, KEYS) == 5  # the 15-row chunk's last row: 130 keys

    out = paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale, keys_per_split=KEYS)

    assert out.dtype == dtype
    expected = reference(batch)  # [num_tokens, num_heads, head_dim]
    num_rows = batch.meta.query_start_loc_list[len(SPLIT_ROWS)]  # the row kernel's rows come first
    assert_close(out[:num_rows].double(), expected[:num_rows], tol=TOLERANCES[dtype], seed=seed)
    assert_close(out[num_rows:].double(), expected[num_rows:], tol=TOLERANCES[dtype], seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_is_the_same_bits_whatever_shares_the_step(dtype: torch.dtype, seed: int):
    """Each sequence alone, in pairs and in the whole step: the grid's chunk axis changes, a row's bits do not."""
    batch = make_batch(SPLIT_ROWS, 2, 3, 48, dtype, seed)
    bounds = list(itertools.pairwise(batch.meta.query_start_loc_list))
    whole = paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale, keys_per_split=KEYS)

    # Alone: one chunk (no combine kernel), two, four; beside a shorter and a longer row; a decode row beside
    # the 15-row chunk that sets the step's chunk axis to 5.
    for seqs in ([0], [1], [2], [5], [7], [0, 5], [3, 8], [2, 4, 6]):
        alone = sub_batch(batch, seqs)
        part = paged_attention_triton(alone.q, alone.kv_cache, alone.meta, alone.scale, keys_per_split=KEYS)
        rows = [row for s in seqs for row in range(*bounds[s])]
        assert torch.equal(part, whole[rows]), f"sequences {seqs} alone differ from the whole step; seed={seed}"


def test_a_grid_sized_for_the_longest_context_gives_the_same_bits(seed: int):
    """A CUDA graph's step sizes the chunk axis for the longest context a row may have, not for its rows'
    (engine/step/decode_graphs.py): the programs past each row's chunks exit, the combine skips one-chunk rows."""
    decode_rows = [row for row in SPLIT_ROWS if row[0] == 1]
    batch = make_batch(decode_rows, 2, 3, 48, torch.float32, seed)
    longest = dataclasses.replace(batch.meta, seq_lens_list=(300,) * len(decode_rows), max_seq_len=300)
    assert (max_row_splits(batch.meta, KEYS), max_row_splits(longest, KEYS)) == (4, 10)

    exact = paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale, keys_per_split=KEYS)
    padded_grid = paged_attention_triton(batch.q, batch.kv_cache, longest, batch.scale, keys_per_split=KEYS)

    assert torch.equal(padded_grid, exact), f"seed={seed}"


def test_rows_of_one_chunk_are_not_split(seed: int):
    """A step whose rows all fit one chunk launches no combine: the same bits as with a chunk longer than all."""
    batch = make_batch([(1, 20), (1, 32), (6, 32)], 2, 3, 64, torch.float32, seed)
    assert max_row_splits(batch.meta, KEYS) == 1

    out = paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale, keys_per_split=KEYS)

    assert torch.equal(out, paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale))
    assert_close(out.double(), reference(batch), tol=1e-4, seed=seed)


def test_the_chunk_axis_is_planned_from_the_host_lists_of_short_segments(seed: int):
    batch = make_batch([(1, 40), (1, 97), (3, 64), (MIN_TILED_ROWS, 200)], 2, 1, 16, torch.float32, seed)
    # No device tensor is read: the plan sees only query_start_loc_list and seq_lens_list.
    host_only = dataclasses.replace(batch.meta, query_start_loc=None, seq_lens=None, token_to_seq=None)

    assert max_row_splits(host_only, KEYS) == 4  # 97 keys; the tiled segment's 200 keys do not count
    assert max_row_splits(host_only, 128) == 1
    assert [num_splits(n, KEYS) for n in (1, 31, 32, 33, 64, 65)] == [1, 1, 1, 2, 2, 3]
    assert KEYS_PER_SPLIT % KEYS == 0  # the default chunk is whole key tiles


@pytest.mark.parametrize("keys_per_split", [0, -32, 48])
def test_keys_per_split_must_be_whole_key_tiles(keys_per_split: int, seed: int):
    batch = make_batch([(1, 40)], 2, 1, 16, torch.float32, seed)
    with pytest.raises(ValueError, match="keys_per_split must be a positive multiple of 32"):
        paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale, keys_per_split=keys_per_split)
