"""Each op of a decoder layer, and the sampler's greedy choice, run once on small random inputs against its
torch implementation on the CPU.

What ``loraplex doctor`` runs on a machine: the op as the engine would run it (the public dispatcher with
the engine's kernel backend, on its device and in its dtype) and the op's torch implementation on the CPU
in float32, both on the same inputs (rounded to the dtype first, so rounding the inputs is no error). The
error is the largest ``|actual - reference| / (1 + |reference|)`` over every output (an op that updates a
tensor in place is judged on that tensor too); it passes within the dtype's tolerance. The shapes are
small but take each kernel's interesting paths: grouped-query heads, decode rows beside a prefill chunk of
at least 16 rows (the tiled Triton kernel), a decode row the Triton row kernel splits into two chunks of
keys, contexts straddling pages, adapters of two ranks beside base-model rows, two modules in one SGMV
launch, a projection whose last weight panel is partial, a tie and a maximum in the last lane for the
argmax. The storage formats (bf16 and int8 weights, bf16 pages) against
float32 are :mod:`loraplex_kernels.format_checks`.
"""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata
from loraplex_kernels.attention.paged_attention import paged_attention
from loraplex_kernels.attention.paged_attention_split import KEYS_PER_SPLIT
from loraplex_kernels.attention.paged_attention_torch import paged_attention_torch
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.layer_ops.add_rms_norm import add_rms_norm, add_rms_norm_torch
from loraplex_kernels.layer_ops.argmax_rows import argmax_rows
from loraplex_kernels.layer_ops.kv_write import kv_row_index
from loraplex_kernels.layer_ops.rope_kv_write import rope_kv_write, rope_kv_write_torch
from loraplex_kernels.layer_ops.silu_mul import silu_mul, silu_mul_torch
from loraplex_kernels.projection.linear import LinearWeight, linear
from loraplex_kernels.sgmv.lora_metadata import build_sgmv_metadata
from loraplex_kernels.sgmv.sgmv_fused import sgmv_fused
from loraplex_kernels.sgmv.sgmv_fused_native import plan_sgmv_native
from loraplex_kernels.sgmv.sgmv_fused_torch import plan_sgmv_fused_torch, sgmv_fused_torch

# Scaled error allowed per dtype: float32 leaves summation order; bf16 and fp16 round every output.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
DELTA_SCALE = 0.25  # the SGMV check's LoRA deltas against its y: about N(0, 1/16) beside N(0, 1)
SEED = 0  # fixed, so two runs of the doctor compare the same numbers
NUM_LAYERS = 2
LAYER = 1  # not 0, so a wrong layer stride reads another layer's data
BLOCK_SIZE = 16
EPS = 1e-5


@dataclass(frozen=True, slots=True)
class OpCheck:
    op: str
    max_error: float  # the largest |actual - reference| / (1 + |reference|)
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_error <= self.tolerance  # False for NaN


@dataclass(frozen=True, slots=True)
class CheckTarget:
    device: torch.device
    dtype: torch.dtype
    backend: KernelBackend
    gen: torch.Generator
    pool_dtype: torch.dtype | None = None  # the pool's (K/V and adapters) under test, when not ``dtype``

    def randn(self, *shape: int) -> torch.Tensor:
        """Random values already rounded to the dtype, in float32 on the CPU."""
        return torch.randn(*shape, generator=self.gen).to(self.dtype).float()

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` as the op under test takes it: on the device, floats in the dtype.

        Always a copy, even on the CPU in float32: the ops update tensors in place, and the reference must
        start from the same inputs.
        """
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=self.device, dtype=dtype, copy=True)

    def put_pool(self, pool: torch.Tensor) -> torch.Tensor:
        """A copy of a page pool as the op under test takes it: in the pool's dtype (rounded), on the device."""
        return pool.to(device=self.device, dtype=self.pool_dtype or self.dtype, copy=True)


def run_op_check(op: str, device: torch.device, dtype: torch.dtype, backend: KernelBackend) -> OpCheck:
    """Run ``op`` (a name in OPS) with ``backend`` on ``device`` in ``dtype`` against its torch implementation."""
    target = CheckTarget(device, dtype, backend, torch.Generator().manual_seed(SEED))
    pairs = OPS[op](target)
    error = pairs_error(pairs)
    return OpCheck(op, error, TOLERANCES[dtype])


Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (the op's output, the reference's)


def largest_error(errors: list[float]) -> float:
    """The largest error; NaN if any is NaN (``max`` would keep whichever came first)."""
    return math.nan if any(math.isnan(error) for error in errors) else max(errors)


def scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest ``|actual - expected| / (1 + |expected|)``, in float64 on the CPU."""
    diff = (actual.detach().to("cpu", torch.float64) - expected.double()).abs()  # like expected
    return float((diff / (1.0 + expected.double().abs())).max())


def pairs_error(pairs: Pairs) -> float:
    """The largest scaled error over every (output, reference) pair."""
    return largest_error([scaled_error(actual, expected) for actual, expected in pairs])


def _paged_attention(t: CheckTarget) -> Pairs:
    num_kv_heads, group, head_dim = 2, 3, 64
    # (query rows, context): decode rows, one of them over two chunks of the Triton row kernel (more than
    # KEYS_PER_SPLIT keys), and a 20-row chunk mid-context.
    seqs = [(1, 17), (1, 40), (1, KEYS_PER_SPLIT + 88), (20, 37)]
    blocks = [math.ceil(seq_len / BLOCK_SIZE) for _, seq_len in seqs]
    num_pages = sum(blocks) + 2
    pages = torch.randperm(num_pages, generator=t.gen)  # [num_pages], out of order
    table = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)  # [num_seqs, max_blocks]
    taken = 0
    for s, num_blocks in enumerate(blocks):
        table[s, :num_blocks] = pages[taken : taken + num_blocks]
        taken += num_blocks
    page_elems = BLOCK_SIZE * 2 * num_kv_heads * head_dim
    storage = t.randn(num_pages, NUM_LAYERS, page_elems)  # [pages, layers, P]
    q_lens = [q_len for q_len, _ in seqs]
    starts = list(itertools.accumulate(q_lens, initial=0))
    meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),  # [num_seqs + 1]
        seq_lens=torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32),  # [num_seqs]
        block_tables=table,
        token_to_seq=torch.repeat_interleave(
            torch.arange(len(seqs), dtype=torch.int32), torch.tensor(q_lens)
        ),  # [num_tokens]
        num_decode_seqs=3,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_len for _, seq_len in seqs),
        query_start_loc_list=tuple(starts),
        seq_lens_list=tuple(seq_len for _, seq_len in seqs),
    )
    q = t.randn(starts[-1], num_kv_heads * group, head_dim)  # [tokens, heads, head_dim]

    def layer_view(pool: torch.Tensor) -> torch.Tensor:
        return pool[:, LAYER].view(num_pages, 2, BLOCK_SIZE, num_kv_heads, head_dim)  # [pages, 2, bs, kvh, d]

    tables = {f.name: getattr(meta, f.name) for f in fields(meta) if isinstance(getattr(meta, f.name), torch.Tensor)}
    on_device = replace(meta, **{name: t.put(table) for name, table in tables.items()})
    scale = head_dim**-0.5
    out = paged_attention(t.put(q), layer_view(t.put_pool(storage)), on_device, scale, t.backend)
    return [(out, paged_attention_torch(q, layer_view(storage), meta, scale))]


def _sgmv_fused(t: CheckTarget) -> Pairs:
    in_dim, out_dims, page_elems = 64, (48, 80), 256
    ranks = (4, 8)  # two adapters, each targeting both modules of the group
    # Each row's length and scale: A rows 1/sqrt(in_dim), so v is about N(0, 1), and Bᵀ rows
    # DELTA_SCALE/sqrt(rank), so each delta is a LoRA's small correction to y ~ N(0, 1), as trained adapters
    # make it; the error measures rounding, not cancellation.
    rows = [
        (dim, scale)
        for rank in ranks
        for out_dim in out_dims
        for dim, scale in [(in_dim, in_dim**-0.5)] * rank + [(out_dim, DELTA_SCALE * rank**-0.5)] * rank
    ]
    # Row i in page i, at an offset that varies (every offset + row fits the page's 256 elements).
    row_addr = [i * NUM_LAYERS * page_elems + (i % 3) * 48 for i in range(len(rows))]
    storage = torch.randn(len(rows), NUM_LAYERS, page_elems, generator=t.gen)  # [pages, layers, P], noise around
    flat = storage.view(-1)  # [pages * layers * P]
    for addr, (dim, scale) in zip(row_addr, rows, strict=True):
        start = addr + LAYER * page_elems
        flat[start : start + dim].mul_(scale)
    storage = storage.to(t.dtype).float()  # [pages, layers, P], rounded to the dtype
    modules = []
    first = 0
    for rank in ranks:
        modules.append([(first, first + rank, rank), (first + 2 * rank, first + 3 * rank, rank)])
        first += 4 * rank
    segments = [(5, modules[0]), (3, None), (6, modules[1]), (2, modules[0])]  # base rows between adapters
    num_tokens = sum(num for num, _ in segments)
    x = t.randn(num_tokens, in_dim)  # [tokens, in_dim]
    y = t.randn(num_tokens, sum(out_dims))  # [tokens, y_width]
    meta = build_sgmv_metadata(segments, row_addr, in_dim, out_dims)
    device_meta = build_sgmv_metadata(segments, row_addr, in_dim, out_dims, device=t.device)
    device_storage, out = t.put_pool(storage), t.put(y)
    plan = None
    if t.backend is KernelBackend.NATIVE:
        plan = plan_sgmv_native(device_meta)
    elif t.backend is KernelBackend.TORCH:
        plan = plan_sgmv_fused_torch(device_storage, device_meta)
    sgmv_fused(t.put(x), device_storage, device_meta, LAYER * page_elems, out, plan, t.backend)
    sgmv_fused_torch(x, storage, meta, LAYER * page_elems, y)
    return [(out, y)]


def _add_rms_norm(t: CheckTarget) -> Pairs:
    x, residual, weight = t.randn(7, 96), t.randn(7, 96), t.randn(96)  # [tokens, hidden] x2, [hidden]
    stream = t.put(x)
    out = add_rms_norm(stream, t.put(residual), t.put(weight), EPS, t.backend)
    expected = add_rms_norm_torch(x, residual, weight, EPS)  # x becomes the stream, in place
    return [(out, expected), (stream, x)]


def _rope_kv_write(t: CheckTarget) -> Pairs:
    num_heads, num_kv_heads, head_dim, block_size, num_tokens = 4, 2, 16, 4, 5
    qkv = t.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)  # [tokens, (heads + 2 kvh) * d]
    angles = torch.rand(num_tokens, head_dim // 2, generator=t.gen) * 6.0  # [tokens, d / 2]
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(t.dtype).float()  # [tokens, d]
    signed_sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(t.dtype).float()  # [tokens, d]
    num_pages = 3
    storage = t.randn(num_pages, NUM_LAYERS, block_size * 2 * num_kv_heads * head_dim)  # [pages, layers, P]
    slots = torch.tensor([9, 0, 5, 6, 11])  # [tokens]: pages 2, 0, 1, 1, 2
    rows = kv_row_index(slots, NUM_LAYERS, block_size)  # [tokens]
    device_qkv, device_storage = t.put(qkv), t.put_pool(storage)
    rope_kv_write(
        device_qkv,
        t.put(cos),
        t.put(signed_sin),
        device_storage,
        LAYER,
        t.put(rows),
        num_heads,
        num_kv_heads,
        t.backend,
    )
    rope_kv_write_torch(qkv, cos, signed_sin, storage, LAYER, rows, num_heads, num_kv_heads)
    return [(device_qkv, qkv), (device_storage, storage)]


def _silu_mul(t: CheckTarget) -> Pairs:
    gate_up = t.randn(9, 2 * 40)  # [tokens, 2 * intermediate]
    return [(silu_mul(t.put(gate_up), t.backend), silu_mul_torch(gate_up))]


def _linear(t: CheckTarget) -> Pairs:
    x, weight, bias = t.randn(9, 96), t.randn(100, 96) / 10, t.randn(100)  # [tokens, in], [out, in], [out]
    prepared = LinearWeight.prepare(t.put(weight), t.put(bias), t.backend)  # 100: a partial last panel
    return [(linear(t.put(x), prepared), F.linear(x, weight, bias))]


def _argmax_rows(t: CheckTarget) -> Pairs:
    logits = t.randn(5, 1000)  # [rows, vocab]; 1000: a tail past the last full vector
    logits[1, 999] = 100.0  # the maximum in the last lane
    logits[2, [3, 700]] = 100.0  # a tie: the first index wins
    same = argmax_rows(t.put(logits), t.backend).cpu() == logits.argmax(dim=-1)  # [rows]
    return [(same.double(), torch.ones(len(same), dtype=torch.float64))]  # a wrong index: error 0.5


OPS: dict[str, Callable[[CheckTarget], Pairs]] = {
    "paged_attention": _paged_attention,
    "sgmv_fused": _sgmv_fused,
    "add_rms_norm": _add_rms_norm,
    "rope_kv_write": _rope_kv_write,
    "silu_mul": _silu_mul,
    "linear": _linear,
    "argmax_rows": _argmax_rows,
}
