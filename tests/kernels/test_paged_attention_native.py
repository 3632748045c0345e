"""The native paged attention against the float64 reference and the torch implementation: decode,
prefill and mixed batches, grouped-query heads (groups 1, 3, 4 and 5), head dims 64 (unrolled) and 48
(generic), contexts straddling page boundaries, chunks longer than one tile, q strided as the fused qkv
output, and bad input."""

import random

import pytest
import torch

from loraplex_kernels.attention.paged_attention import paged_attention
from loraplex_kernels.attention.paged_attention_torch import paged_attention_torch
from loraplex_kernels.backend import KernelBackend
from tests.kernels.test_paged_attention import (
    BATCHES,
    HEAD_DIMS,
    HEADS,
    Batch,
    assert_close,
    make_batch,
    reference,
)
from tests.kernels.threads import torch_threads

# Chunks longer than a tile (128 query vectors: 128 rows at group 1, 42 at group 3), some starting
# mid-context, beside decode rows and a one-row chunk; 700 keys cross 44 pages. Short chunks are one item
# over all kv heads, longer ones items of (kv head, tile of rows).
LONG = [(1, 300), (1, 17), (150, 400), (70, 70), (1, 1), (33, 700)]
BATCHES_NATIVE = {**BATCHES, "long": LONG}
# The row path scores a row's grouped heads in chunks of three vectors (AVX-512), then two, then one:
# group 5 adds the chunk of two.
HEADS_NATIVE = [*HEADS, (1, 5)]
TOL = 2e-5


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, shown when a comparison fails so the case can be replayed."""
    return random.randrange(2**31)


def run_native(native, batch: Batch, q: torch.Tensor | None = None) -> torch.Tensor:
    meta = batch.meta
    q = batch.q if q is None else q
    return native.paged_attention(
        q, batch.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, batch.scale
    )  # [num_tokens, num_heads, head_dim]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize(("num_kv_heads", "group"), HEADS_NATIVE)
@pytest.mark.parametrize("kind", list(BATCHES_NATIVE))
def test_native_matches_float64_reference_and_torch(
    native, kind: str, num_kv_heads: int, group: int, head_dim: int, seed: int
):
    batch = make_batch(BATCHES_NATIVE[kind], num_kv_heads, group, head_dim, torch.float32, seed)
    expected = reference(batch)

    out = run_native(native, batch)
    dispatched = paged_attention(batch.q, batch.kv_cache, batch.meta, batch.scale, KernelBackend.NATIVE)
    torch_out = paged_attention_torch(batch.q, batch.kv_cache, batch.meta, batch.scale)

    assert out.dtype == torch.float32 and out.shape == batch.q.shape and out.is_contiguous()
    assert_close(out.double(), expected, tol=TOL, seed=seed)
    assert_close(out, torch_out, tol=TOL, seed=seed)
    assert_close(dispatched, out, tol=0.0, seed=seed)


@pytest.mark.parametrize("head_dim", [40, 128])
def test_native_other_head_dims(native, head_dim: int, seed: int):
    """40: a last eight dims on their own after the sixteen-lane loads; 128: the other unrolled size."""
    batch = make_batch(LONG, 2, 4, head_dim, torch.float32, seed)
    assert_close(run_native(native, batch).double(), reference(batch), tol=TOL, seed=seed)


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_native_any_block_size(native, block_size: int, seed: int):
    """Pages smaller than the eight keys scored at once (a block of keys spans pages) and larger ones."""
    batch = make_batch(BATCHES["mixed"] + [(40, 75)], 3, 3, 64, torch.float32, seed, block_size=block_size)
    assert batch.kv_cache.shape[2] == block_size
    assert_close(run_native(native, batch).double(), reference(batch), tol=TOL, seed=seed)


@pytest.mark.parametrize(("num_kv_heads", "group"), HEADS)
def test_native_reads_q_strided_as_the_fused_qkv_output(native, num_kv_heads: int, group: int, seed: int):
    """q as the model passes it: the first num_heads * head_dim columns of [num_tokens, (heads + 2 kv) * D]."""
    batch = make_batch(BATCHES["mixed"], num_kv_heads, group, 64, torch.float32, seed)
    num_tokens, num_heads, head_dim = batch.q.shape
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)  # [tokens, qkv]
    qkv[:, : num_heads * head_dim] = batch.q.reshape(num_tokens, -1)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # [tokens, heads, D], strided
    assert not q.is_contiguous()

    out = run_native(native, batch, q)

    assert_close(out.double(), reference(batch), tol=TOL, seed=seed)
    assert_close(out, run_native(native, batch), tol=0.0, seed=seed)


def test_native_same_result_on_one_thread_and_two(native, seed: int):
    """Each item runs on one thread whatever the split, so the result does not depend on the thread count."""
    batch = make_batch(LONG, 3, 3, 64, torch.float32, seed)
    with torch_threads(1):
        alone = run_native(native, batch)
    with torch_threads(2):
        shared = run_native(native, batch)
    assert_close(shared, alone, tol=0.0, seed=seed)


def test_native_reads_no_page_outside_the_sequences_contexts(native, seed: int):
    """Poisoning every page no sequence owns (and the table's padding column) with NaN changes nothing."""
    batch = make_batch(BATCHES["mixed"], 3, 3, 64, torch.float32, seed)
    expected = run_native(native, batch)
    used = set()
    meta = batch.meta
    for s, seq_len in enumerate(meta.seq_lens_list):
        used.update(meta.block_tables[s, : -(-seq_len // batch.kv_cache.shape[2])].tolist())
    foreign = [p for p in range(batch.kv_cache.shape[0]) if p not in used]
    assert foreign
    batch.kv_cache[foreign] = float("nan")
    assert_close(run_native(native, batch), expected, tol=0.0, seed=seed)


def test_native_empty_step_and_empty_sequences(native, seed: int):
    batch = make_batch([(1, 5), (3, 9)], 2, 2, 64, torch.float32, seed)
    meta = batch.meta
    # A sequence with no query rows this step, between two that have some.
    starts = torch.tensor([0, 1, 1, 4], dtype=torch.int32)
    seq_lens = torch.tensor([5, 7, 9], dtype=torch.int32)
    tables = torch.cat([meta.block_tables[:1], meta.block_tables[:1], meta.block_tables[1:]])  # [3, max_blocks]
    out = native.paged_attention(batch.q, batch.kv_cache, tables, seq_lens, starts, batch.scale)
    assert_close(out, run_native(native, batch), tol=0.0, seed=seed)

    empty = native.paged_attention(
        batch.q[:0], batch.kv_cache, meta.block_tables[:0], meta.seq_lens[:0], meta.query_start_loc[:1], batch.scale
    )
    assert empty.shape == (0, *batch.q.shape[1:])


def test_native_rejects_bad_inputs(native, seed: int):
    batch = make_batch(BATCHES["decode"], 2, 2, 64, torch.float32, seed)
    meta = batch.meta

    def call(**changes):
        args = {
            "q": batch.q,
            "kv_cache": batch.kv_cache,
            "block_tables": meta.block_tables,
            "seq_lens": meta.seq_lens,
            "query_start_loc": meta.query_start_loc,
        }
        args.update(changes)
        return native.paged_attention(*args.values(), batch.scale)

    with pytest.raises(ValueError, match="float32"):
        call(q=batch.q.double())
    with pytest.raises(ValueError, match="contiguous along head_dim"):
        call(q=batch.q.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        call(q=batch.q[:, :3])
    with pytest.raises(ValueError, match="int32"):
        call(seq_lens=meta.seq_lens.long())
    with pytest.raises(ValueError, match="not a page of the pool"):
        bad = meta.block_tables.clone()
        bad[1, 0] = batch.kv_cache.shape[0]  # one past the last page
        call(block_tables=bad)
    with pytest.raises(ValueError, match="needs"):
        call(block_tables=meta.block_tables[:, :1].contiguous())  # 65 keys need 5 pages
    with pytest.raises(ValueError, match="query_start_loc"):
        call(query_start_loc=meta.query_start_loc.flip(0).contiguous())
    with pytest.raises(ValueError, match="seq_len"):
        call(seq_lens=torch.zeros_like(meta.seq_lens))
    with pytest.raises(ValueError, match="each page of kv_cache must be contiguous"):
        pages, _, block_size, num_kv_heads, head_dim = batch.kv_cache.shape
        wide = torch.randn(pages, 2, block_size, num_kv_heads, 2 * head_dim)  # [pages, 2, bs, kvh, 2 D]
        call(kv_cache=wide[..., :head_dim])
