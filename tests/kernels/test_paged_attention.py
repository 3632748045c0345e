"""Paged attention: the Triton kernel (under the interpreter) and the torch implementation against a
float64 reference, over decode, prefill and mixed batches with grouped-query heads."""

import dataclasses
import math
import random

import pytest
import torch

from loraplex_kernels.attention.attention_metadata import (
    MAX_DECODE_BUCKETS,
    PagedAttentionMetadata,
    plan_decode_buckets,
)
from loraplex_kernels.attention.paged_attention import paged_attention
from loraplex_kernels.attention.paged_attention_torch import paged_attention_torch
from loraplex_kernels.attention.paged_attention_triton import paged_attention_triton

BLOCK_SIZE = 16
NUM_LAYERS = 3
LAYER = 1  # not 0, so a wrong page stride reads another layer's pages
SPARE_PAGES = 4  # pages owned by no sequence, so a wrong page id reads foreign data

# (q_len, seq_len) per sequence; decode sequences first, as the metadata builder orders them.
# Context lengths straddle page boundaries (1, 15, 16, 17, 33, 64, 65 tokens).
DECODE = [(1, 1), (1, 17), (1, 64), (1, 33), (1, 65)]
PREFILL = [(15, 15), (20, 37), (5, 16)]  # from scratch, chunk starting mid-context, chunk filling a page
MIXED = [(1, 16), (1, 7), (1, 50), (4, 19), (3, 3), (9, 41), (2, 33)]
BATCHES = {"decode": DECODE, "prefill": PREFILL, "mixed": MIXED}  # 5, 3 and 7 sequences

# (num_kv_heads, group): plain multi-head, SmolLM2's 3 kv heads × 3, and a power-of-two group.
HEADS = [(2, 1), (3, 3), (2, 4)]
HEAD_DIMS = [64, 48]


@dataclasses.dataclass(frozen=True)
class Batch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [num_pages, 2, block_size, num_kv_heads, head_dim], a layer view of the pool
    meta: PagedAttentionMetadata
    scale: float


def make_batch(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    block_size: int = BLOCK_SIZE,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    num_decode_seqs = next((i for i, (q_len, _) in enumerate(seqs) if q_len != 1), len(seqs))
    blocks_per_seq = [math.ceil(seq_len / block_size) for _, seq_len in seqs]
    num_pages = sum(blocks_per_seq) + SPARE_PAGES
    page_ids = torch.randperm(num_pages, generator=gen)  # [num_pages], shuffled so pages are not in order
    max_num_blocks = max(blocks_per_seq) + 1  # one padding column for every sequence
    block_tables = torch.zeros(len(seqs), max_num_blocks, dtype=torch.int32)  # [num_seqs, max_num_blocks]
    taken = 0
    for s, num_blocks in enumerate(blocks_per_seq):
        block_tables[s, :num_blocks] = page_ids[taken : taken + num_blocks]
        taken += num_blocks

    page_numel = block_size * 2 * num_kv_heads * head_dim
    storage = torch.randn(num_pages, NUM_LAYERS, page_numel, generator=gen).to(dtype)  # [pages, layers, P]
    layer_view = storage[:, LAYER]  # [num_pages, P]
    kv_cache = layer_view.view(num_pages, 2, block_size, num_kv_heads, head_dim)  # [pages, 2, bs, kvh, d]
    assert kv_cache.stride(0) == NUM_LAYERS * page_numel

    q_lens = [q_len for q_len, _ in seqs]
    seq_lens = [seq_len for _, seq_len in seqs]
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)  # [tokens, heads, d]
    query_start_loc = [0]
    for q_len in q_lens:
        query_start_loc.append(query_start_loc[-1] + q_len)
    token_to_seq = torch.repeat_interleave(
        torch.arange(len(seqs), dtype=torch.int32), torch.tensor(q_lens)
    )  # [num_tokens]
    meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),  # [num_seqs + 1]
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [num_seqs]
        block_tables=block_tables,
        token_to_seq=token_to_seq,
        num_decode_seqs=num_decode_seqs,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_list=tuple(query_start_loc),
        seq_lens_list=tuple(seq_lens),
    )
    return Batch(q=q, kv_cache=kv_cache, meta=meta, scale=head_dim**-0.5)


def reference(batch: Batch) -> torch.Tensor:
    """Float64 attention, one sequence at a time, over K/V gathered position by position."""
    q = batch.q.double()  # [num_tokens, num_heads, head_dim]
    kv = batch.kv_cache.double()  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    group = q.shape[1] // kv.shape[3]
    block_size = kv.shape[2]
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    meta = batch.meta
    for s in range(meta.num_seqs):
        start, end = meta.query_start_loc_list[s], meta.query_start_loc_list[s + 1]
        seq_len = meta.seq_lens_list[s]
        pages = [int(meta.block_tables[s, p // block_size]) for p in range(seq_len)]
        k = torch.stack([kv[pages[p], 0, p % block_size] for p in range(seq_len)])  # [seq_len, kvh, d]
        v = torch.stack([kv[pages[p], 1, p % block_size] for p in range(seq_len)])  # [seq_len, kvh, d]
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * batch.scale  # [heads, q_len, seq_len]
        positions = torch.arange(seq_len - (end - start), seq_len)  # [q_len]
        future = torch.arange(seq_len)[None, :] > positions[:, None]  # [q_len, seq_len]
        scores = scores.masked_fill(future, float("-inf"))  # [heads, q_len, seq_len]
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)  # [q_len, heads, d]
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, seed: int) -> None:
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, msg=lambda m: f"{m}\nseed={seed}")


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, shown when a comparison fails so the case can be replayed."""
    return random.randrange(2**31)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize(("num_kv_heads", "group"), HEADS)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_triton_and_torch_match_float64_reference(kind: str, num_kv_heads: int, group: int, head_dim: int, seed: int):
    batch = make_batch(BATCHES[kind], num_kv_heads, group, head_dim, torch.float32, seed)
    expected = reference(batch)

    out = paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale)

    assert out.dtype == torch.float32
    assert out.shape == batch.q.shape
    assert_close(out.double(), expected, tol=1e-4, seed=seed)

    # The interpreter is slow, so the Triton output above is reused against the torch implementation.
    torch_out = paged_attention_torch(batch.q, batch.kv_cache, batch.meta, batch.scale)
    dispatched = paged_attention(batch.q, batch.kv_cache, batch.meta, batch.scale)  # CPU: the torch path

    assert_close(torch_out.double(), expected, tol=1e-4, seed=seed)
    assert_close(out, torch_out, tol=1e-4, seed=seed)
    assert_close(dispatched, torch_out, tol=0.0, seed=seed)


@pytest.mark.parametrize("kind", ["decode", "prefill"])  # prefill: the row kernel's short chunks and a tiled one
def test_triton_reads_a_block_table_stored_by_column(kind: str, seed: int):
    """A CUDA graph's block table is the transpose of a [max_blocks, max_rows] buffer, wider and taller than the
    step's; its entries past each row's pages name another page. The Triton kernels give the same bits."""
    batch = make_batch(BATCHES[kind], 3, 3, 64, torch.float32, seed)
    table = batch.meta.block_tables  # [num_seqs, num_blocks]
    num_seqs, num_blocks = table.shape
    foreign_page = batch.kv_cache.shape[0] - 1
    columns = torch.full((num_blocks + 2, num_seqs + 3), foreign_page, dtype=torch.int32)  # [blocks, rows]
    columns[:num_blocks, :num_seqs] = table.t()
    by_column = columns.t()[:num_seqs]  # [num_seqs, num_blocks + 2], strides (1, num_seqs + 3)
    assert by_column.stride() == (1, num_seqs + 3)

    out = paged_attention_triton(
        batch.q, batch.kv_cache, dataclasses.replace(batch.meta, block_tables=by_column), batch.scale
    )

    assert_close(out, paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale), tol=0.0, seed=seed)


@pytest.mark.parametrize("sort_by_length", [True, False])
def test_torch_decode_buckets_match_reference(seed: int, sort_by_length: bool):
    """37 decode rows plus a prefill chunk: the CPU path splits the decode rows into several buckets."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 90) for _ in range(37)]
    if sort_by_length:
        lens.sort()
    batch = make_batch([(1, n) for n in lens] + [(6, 40)], 3, 3, 64, torch.float32, seed)
    buckets = plan_decode_buckets(
        batch.meta.seq_lens_list, batch.meta.block_tables, batch.meta.num_decode_seqs, BLOCK_SIZE, torch.float32
    )
    assert len(buckets) == MAX_DECODE_BUCKETS and buckets[-1].end == 37
    planned = dataclasses.replace(batch.meta, decode_buckets=buckets)
    expected = reference(batch)
    assert_close(paged_attention_torch(batch.q, batch.kv_cache, planned, batch.scale).double(), expected, 1e-4, seed)
    assert_close(paged_attention_torch(batch.q, batch.kv_cache, batch.meta, batch.scale).double(), expected, 1e-4, seed)


def test_triton_bfloat16_close_to_reference(seed: int):
    batch = make_batch(MIXED, 3, 3, 64, torch.bfloat16, seed)
    expected = reference(batch)

    out = paged_attention_triton(batch.q, batch.kv_cache, batch.meta, batch.scale)

    assert out.dtype == torch.bfloat16
    assert_close(out.double(), expected, tol=2e-2, seed=seed)


def test_triton_rejects_bad_inputs(seed: int):
    batch = make_batch(DECODE, 2, 2, 64, torch.float32, seed)
    q, kv, meta, scale = batch.q, batch.kv_cache, batch.meta, batch.scale

    with pytest.raises(ValueError, match="dtype"):
        paged_attention_triton(q, kv.half(), meta, scale)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention_triton(q.transpose(0, 1).contiguous().transpose(0, 1), kv, meta, scale)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_triton(q[..., :32].contiguous(), kv, meta, scale)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_triton(q[:, :3].contiguous(), kv, meta, scale)
    with pytest.raises(ValueError, match="int32"):
        bad_meta = dataclasses.replace(meta, block_tables=meta.block_tables.long())
        paged_attention_triton(q, kv, bad_meta, scale)
    with pytest.raises(ValueError, match="token_to_seq"):
        paged_attention_triton(q[:-1].contiguous(), kv, meta, scale)
