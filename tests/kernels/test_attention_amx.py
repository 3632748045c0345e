"""The paged attention's tiled path on AMX tiles (bf16 pages, a CPU with AMX-BF16, head_dim a multiple of 32):
prefill chunks against the float64 reference over the same bf16 K/V, grouped heads (1, 3, 4, 5), head dims
32 to 256, pages of 4, 16 and 32 tokens, chunks longer than a tile and chunks starting mid-context;
the result of a sequence the same bits alone, in a batch, on one thread or two.

Tolerance: the path rounds the pre-scaled q and the softmax weights to bf16 (8 bits of mantissa) for the
tile unit's products, the scores, softmax and sums stay fp32; on unit-scale inputs the outputs measured up
to 5.6e-3 from the reference (a wrong key, head or scale is off by tenths).
"""

import dataclasses

import pytest
import torch

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.linear_dot import amx_available
from loraplex_kernels.paged_attention import paged_attention
from tests.kernels.test_paged_attention import Batch, make_batch, reference
from tests.kernels.threads import torch_threads

AMX_TOL = 2e-2

# (q_len, seq_len): a chunk from scratch, chunks longer than a tile starting mid-context, a short chunk of
# 12 rows beside decode rows (row path), and one straddling pages.
CHUNKS = [(1, 40), (1, 3), (70, 70), (150, 400), (12, 30), (33, 97)]


@pytest.fixture(autouse=True)
def amx_tiles(native) -> None:
    """Skips where the native kernels run no AMX tiles (asked at run time, not when the file is imported)."""
    if not amx_available():
        pytest.skip("the native kernels run no AMX tiles here")


def run(batch: Batch) -> torch.Tensor:
    return paged_attention(batch.q, batch.kv_cache, batch.meta, batch.scale, KernelBackend.NATIVE)


def bf16_batch(seqs: list[tuple[int, int]], num_kv_heads: int, group: int, head_dim: int, seed: int, **kw) -> Batch:
    """A batch on bf16 pages with fp32 q (the engine's bf16 mode)."""
    batch = make_batch(seqs, num_kv_heads, group, head_dim, torch.bfloat16, seed, **kw)
    return Batch(q=batch.q.float(), kv_cache=batch.kv_cache, meta=batch.meta, scale=batch.scale)


def widened(batch: Batch) -> Batch:
    return Batch(q=batch.q, kv_cache=batch.kv_cache.float(), meta=batch.meta, scale=batch.scale)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (3, 3), (2, 4), (1, 5)])
def test_amx_tiles_match_the_reference(native, num_kv_heads: int, group: int, head_dim: int, seed: int):
    batch = bf16_batch(CHUNKS, num_kv_heads, group, head_dim, seed)

    out = run(batch)

    expected = reference(widened(batch))  # the bf16 values exactly, in float64
    torch.testing.assert_close(out.double(), expected, atol=AMX_TOL, rtol=AMX_TOL, msg=lambda m: f"{m} {seed=}")
    # the tile unit ran: fp32 pages of the same values take the fp32 tiled path, whose result differs
    assert not torch.equal(out, run(widened(batch)))


@pytest.mark.parametrize("block_size", [4, 32])
def test_amx_tiles_any_block_size(native, block_size: int, seed: int):
    batch = bf16_batch(CHUNKS, 3, 3, 64, seed, block_size=block_size)
    expected = reference(widened(batch))
    torch.testing.assert_close(run(batch).double(), expected, atol=AMX_TOL, rtol=AMX_TOL, msg=lambda m: f"{m} {seed=}")


def test_a_sequence_gets_the_same_bits_alone_in_a_batch_and_on_two_threads(native, seed: int):
    batch = bf16_batch(CHUNKS, 3, 3, 64, seed)
    starts = batch.meta.query_start_loc_list
    with torch_threads(1):
        one_thread = run(batch)
    with torch_threads(2):
        two_threads = run(batch)
    assert torch.equal(one_thread, two_threads)

    index = 3  # the 150-row chunk of a 400-token context
    alone = bf16_batch([CHUNKS[index]], 3, 3, 64, seed)
    # the same pages through the sequence's own block table row, with q of its rows
    meta = dataclasses.replace(alone.meta, block_tables=batch.meta.block_tables[index : index + 1])
    q = batch.q[starts[index] : starts[index + 1]].clone()
    single = run(Batch(q=q, kv_cache=batch.kv_cache, meta=meta, scale=batch.scale))
    assert torch.equal(single, two_threads[starts[index] : starts[index + 1]])
