"""bf16 K/V in the page pool on the native CPU kernels: the K/V write rounds fp32 rows to bf16 (nearest even,
bit for bit as torch does), and paged attention reads bf16 pages (decode rows, prefill chunks, head dims 64
and 48) with fp32 scores, softmax and accumulation.

Tolerances: on the bf16 values themselves the kernel is as exact as on fp32 pages (widening is exact), so
it meets the fp32 kernel's 2e-5 against float64; against attention over the unrounded fp32 K/V it differs
by the K/V's rounding alone, within 2e-2 on unit-scale inputs (bf16 keeps 8 bits of mantissa).

Run under LORAPLEX_NATIVE_MARCH=haswell too, to test the AVX2 widening.
"""

import pytest
import torch

from loraplex_kernels.attention.paged_attention import paged_attention
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.layer_ops.kv_write import kv_row_index
from loraplex_kernels.layer_ops.rope_kv_write import rope_kv_write, rope_kv_write_torch
from tests.kernels.test_paged_attention import BATCHES, Batch, make_batch, reference
from tests.kernels.test_paged_attention_native import LONG, TOL
from tests.kernels.threads import torch_threads

BF16_VS_FP32_TOL = 2e-2  # attention over bf16-rounded K/V against the same over the fp32 K/V
KINDS = {"decode": BATCHES["decode"], "mixed": BATCHES["mixed"], "long": LONG}
NUM_LAYERS = 3
LAYER = 1


def with_kv(batch: Batch, kv_cache: torch.Tensor) -> Batch:
    return Batch(q=batch.q, kv_cache=kv_cache, meta=batch.meta, scale=batch.scale)


def run(batch: Batch) -> torch.Tensor:
    return paged_attention(batch.q, batch.kv_cache, batch.meta, batch.scale, KernelBackend.NATIVE)


@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (3, 3), (1, 5)])
@pytest.mark.parametrize("kind", list(KINDS))
def test_attention_on_bf16_pages(native, kind: str, num_kv_heads: int, group: int, head_dim: int, seed: int):
    batch = make_batch(KINDS[kind], num_kv_heads, group, head_dim, torch.float32, seed)
    bf16_batch = with_kv(batch, batch.kv_cache.to(torch.bfloat16))  # a layer's view of a bf16 pool, copied

    out = run(bf16_batch)

    assert out.dtype == torch.float32 and out.shape == batch.q.shape
    widened = with_kv(batch, bf16_batch.kv_cache.float())  # the bf16 values exactly, in fp32
    tol = TOL
    torch.testing.assert_close(out.double(), reference(widened), atol=tol, rtol=tol, msg=lambda m: f"{m} {seed=}")
    torch.testing.assert_close(out, run(widened), atol=tol, rtol=tol, msg=lambda m: f"{m} {seed=}")
    fp32 = reference(batch)  # over the unrounded K/V
    tol = BF16_VS_FP32_TOL
    torch.testing.assert_close(out.double(), fp32, atol=tol, rtol=tol, msg=lambda m: f"{m} {seed=}")


def test_attention_reads_a_layer_view_of_a_bf16_pool(native, seed: int):
    """Pages strided by the pool's layers (the engine's kv_layer view), any block size, one or two threads."""
    batch = make_batch(LONG, 3, 3, 64, torch.bfloat16, seed, block_size=4)
    assert batch.kv_cache.dtype == torch.bfloat16 and not batch.kv_cache.is_contiguous()
    q = batch.q.float()
    batch = Batch(q=q, kv_cache=batch.kv_cache, meta=batch.meta, scale=batch.scale)
    with torch_threads(1):
        alone = run(batch)
    with torch_threads(2):
        shared = run(batch)
    expected = reference(with_kv(batch, batch.kv_cache.float()))
    tol = TOL
    torch.testing.assert_close(alone.double(), expected, atol=tol, rtol=tol, msg=lambda m: f"{m} {seed=}")
    assert torch.equal(alone, shared)


def test_attention_refuses_other_kv_dtypes(native, seed: int):
    batch = make_batch(BATCHES["decode"], 2, 2, 64, torch.float32, seed)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        run(with_kv(batch, batch.kv_cache.half()))


def write_both(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor, heads: tuple):
    """The native write into a bf16 pool and the torch write into another: (native pool, torch pool)."""
    num_heads, num_kv_heads, head_dim, block_size = heads
    page = block_size * 2 * num_kv_heads * head_dim
    pools = [torch.full((4, NUM_LAYERS, page), 7.0, dtype=torch.bfloat16) for _ in range(2)]  # [pages, L, P]
    rows = kv_row_index(slots, NUM_LAYERS, block_size)  # [tokens]
    native_qkv, torch_qkv = qkv.clone(), qkv.clone()
    rope_kv_write(native_qkv, cos, signed_sin, pools[0], LAYER, rows, num_heads, num_kv_heads, KernelBackend.NATIVE)
    rope_kv_write_torch(torch_qkv, cos, signed_sin, pools[1], LAYER, rows, num_heads, num_kv_heads)
    torch.testing.assert_close(native_qkv, torch_qkv, atol=1e-6, rtol=1e-6, equal_nan=True)  # rotated in fp32
    return pools


def test_kv_write_rounds_to_nearest_even_as_torch_does(native, seed: int):
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    gen = torch.Generator().manual_seed(seed)
    num_tokens = 7
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 6.0  # [tokens, d / 2]
    cos = torch.cat([angles.cos()] * 2, dim=-1)  # [tokens, d]
    signed_sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)  # [tokens, d]
    # Token 0 unrotated (cos 1, sin 0) with ties and specials in its v: halfway cases round to the even
    # neighbour (1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6), a carry into the exponent, inf and NaN.
    cos[0], signed_sin[0] = 1.0, 0.0
    v0 = (num_heads + num_kv_heads) * head_dim
    specials = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2 - 2**-9, float("inf"), float("-inf"), float("nan"), 1e-40]
    qkv[0, v0 : v0 + len(specials)] = torch.tensor(specials)
    slots = torch.tensor([9, 0, 5, 6, 11, 3, 14])  # [tokens]: pages 2, 0, 1, 1, 2, 0, 3

    native_pool, torch_pool = write_both(qkv, cos, signed_sin, slots, (num_heads, num_kv_heads, head_dim, block_size))

    nan = native_pool.isnan()
    assert torch.equal(nan, torch_pool.isnan()) and int(nan.sum()) == 1  # a NaN stays one (its payload may differ)
    assert torch.equal(native_pool.view(torch.int16)[~nan], torch_pool.view(torch.int16)[~nan])  # the same bits
    v_row = native_pool[2, LAYER].view(2, block_size, num_kv_heads * head_dim)[1, 1]  # token 0 (slot 9): page 2, 1
    got = v_row[: len(specials)].float().tolist()
    assert got[:4] == [1.0, 1 + 2**-6, -1.0, 2.0]
    assert got[4:6] == [float("inf"), float("-inf")] and got[6] != got[6]
    assert (native_pool[:, [0, 2]] == 7.0).all()  # other layers untouched
