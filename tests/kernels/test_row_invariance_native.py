"""A row's result in the native CPU kernels is the same bits whatever else the call computes.

A speculating sequence's k + 1 verification rows, a prefill chunk of any length and a sequence recomputed
after a preemption must produce, row for row, what a decode step computes for that position alone: the
engine's output is then the same whatever runs beside a request (docs/speculative-decoding.md). Checked
here op by op with no tolerance: paged attention (a chunk's row against the same row as a decode row of
the shorter context, fp32 and bf16 pages, each head grouping), the projections (a row in a batch of any
size against the row alone: fp32, bf16 widened and dot panels, int8 widened and VNNI panels, the fused
gate/up), and the Triton row kernel that verification chunks take. Run under LORAPLEX_NATIVE_MARCH=haswell
too (tests/kernels/test_avx2_build.py).
"""

import dataclasses

import pytest
import torch

from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata
from loraplex_kernels.attention.paged_attention import paged_attention
from loraplex_kernels.attention.paged_prefill_attention import MIN_TILED_ROWS
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.projection.linear import DOT, WIDEN, LinearWeight, linear, linear_silu_mul
from loraplex_kernels.projection.linear_dot import amx_available, dot_available
from loraplex_kernels.projection.linear_vnni import vnni_available
from tests.kernels.test_paged_attention import Batch, make_batch

# (query rows, context): a verification chunk (k + 1 = 6 rows), chunks of few and many vectors per kv
# head, one crossing a tile of 128 query vectors, one starting at position 0.
CHUNKS = [(6, 40), (2, 19), (3, 70), (17, 17), (150, 300)]
HEADS = [(3, 3), (2, 1), (2, 4), (1, 5)]  # (num_kv_heads, group)
ROW_COUNTS = [1, 2, 5, 7, 16, 33, 64]  # batch sizes around the GEMMs' row tiles (4 or 8, AMX's 16)


def as_decode_rows(batch: Batch) -> Batch:
    """The same query rows, each its own sequence of one decode row at its position (same pages and K/V)."""
    meta = batch.meta
    seq_lens, tables = [], []
    for s in range(meta.num_seqs):
        start, end = meta.query_start_loc_list[s], meta.query_start_loc_list[s + 1]
        for row in range(start, end):
            seq_lens.append(meta.seq_lens_list[s] - (end - row) + 1)  # keys the row sees
            tables.append(meta.block_tables[s])
    num_tokens = len(seq_lens)
    starts = list(range(num_tokens + 1))
    decode_meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),  # [num_tokens + 1]
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [num_tokens]
        block_tables=torch.stack(tables),  # [num_tokens, max_blocks]
        token_to_seq=torch.arange(num_tokens, dtype=torch.int32),  # [num_tokens]
        num_decode_seqs=num_tokens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_list=tuple(starts),
        seq_lens_list=tuple(seq_lens),
    )
    return dataclasses.replace(batch, meta=decode_meta)


def differing_rows(out: torch.Tensor, decoded: torch.Tensor) -> list[int]:
    return (out != decoded).flatten(1).any(dim=1).nonzero().flatten().tolist()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize(("num_kv_heads", "group"), HEADS)
def test_native_attention_rows_of_a_chunk_are_decode_rows(native, kv_dtype, head_dim, num_kv_heads, group, seed: int):
    batch = make_batch([(1, 33), *CHUNKS], num_kv_heads, group, head_dim, kv_dtype, seed)
    batch = dataclasses.replace(batch, q=batch.q.float())  # the native op's q is fp32 whatever the pages
    out = paged_attention(batch.q, batch.kv_cache, batch.meta, batch.scale, KernelBackend.NATIVE)
    decoded = paged_attention(batch.q, batch.kv_cache, as_decode_rows(batch).meta, batch.scale, KernelBackend.NATIVE)
    assert not differing_rows(out, decoded), f"seed {seed}: rows {differing_rows(out, decoded)} differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_verification_rows_are_decode_rows(dtype, seed: int):
    """Chunks shorter than the tiled kernel's MIN_TILED_ROWS (k + 1 verification rows) take the row kernel."""
    batch = make_batch([(1, 33), (6, 40), (MIN_TILED_ROWS - 1, 50)], 2, 3, 32, dtype, seed)
    out = paged_attention(batch.q, batch.kv_cache, batch.meta, batch.scale, KernelBackend.TRITON)
    decoded = paged_attention(batch.q, batch.kv_cache, as_decode_rows(batch).meta, batch.scale, KernelBackend.TRITON)
    assert not differing_rows(out, decoded), f"seed {seed}: rows {differing_rows(out, decoded)} differ"


def gemm_formats() -> list[tuple[torch.dtype, str | None, str]]:
    """(weight dtype, quantization, bf16_gemm) of every native GEMM this CPU runs."""
    formats = [(torch.float32, None, WIDEN), (torch.bfloat16, None, WIDEN), (torch.float32, "int8", WIDEN)]
    if dot_available() or amx_available():
        formats.append((torch.bfloat16, None, DOT))
    if vnni_available():
        formats.append((torch.float32, "int8", DOT))
    return formats


@pytest.mark.parametrize("fused", [False, True], ids=["linear", "gate_up"])
def test_projection_row_is_the_same_in_any_batch(native, fused: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    in_features, out_features = 200, 2 * 96 if fused else 173
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5  # [out, in]
    x = torch.randn(max(ROW_COUNTS), in_features, generator=gen)  # [rows, in]
    for dtype, quantization, gemm in gemm_formats():
        prepared = LinearWeight.prepare(weight.to(dtype), None, KernelBackend.NATIVE, quantization, gemm)

        def run(rows: torch.Tensor, prepared=prepared) -> torch.Tensor:
            return linear_silu_mul(rows, prepared, KernelBackend.NATIVE) if fused else linear(rows, prepared)

        alone = torch.cat([run(x[i : i + 1]) for i in range(x.shape[0])])  # [rows, out]
        for num_rows in ROW_COUNTS:
            batched = run(x[:num_rows])
            differing = (batched != alone[:num_rows]).any(dim=1).nonzero().flatten().tolist()
            where = f"{prepared.layout} ({dtype}, {quantization})"
            assert not differing, f"seed {seed}: {where} rows {differing} of {num_rows} differ from the rows alone"
