"""The native layer glue (add + RMSNorm, SiLU·mul, RoPE + K/V write) against float64 references and
their torch implementations, on fresh random inputs: widths with and without a tail past the vectors,
strided rows, and the pool rows around each written slot left alone."""

import random

import pytest
import torch

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.layer_ops.add_rms_norm import add_rms_norm, add_rms_norm_torch
from loraplex_kernels.layer_ops.kv_write import kv_row_index
from loraplex_kernels.layer_ops.rope_kv_write import rope_kv_write, rope_kv_write_torch
from loraplex_kernels.layer_ops.silu_mul import silu_mul, silu_mul_torch

TOL = 1e-5
EPS = 1e-5


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, seed: int) -> None:
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, msg=lambda m: f"{m}\nseed={seed}")


# ---- add + RMSNorm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [576, 100, 7])  # SmolLM2's, one with a 4-float tail, one shorter than a vector
@pytest.mark.parametrize("num_tokens", [1, 13, 257])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_reference_and_torch(native, hidden: int, num_tokens: int, with_residual: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen) * 3  # [tokens, hidden]
    residual = torch.randn(num_tokens, hidden, generator=gen) if with_residual else None  # [tokens, hidden]
    weight = torch.rand(hidden, generator=gen) + 0.5  # [hidden]

    stream = x.double() + (residual.double() if with_residual else 0)  # [tokens, hidden]
    expected = weight.double() * stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + EPS)

    x_native, x_torch = x.clone(), x.clone()
    out = native.add_rms_norm(x_native, residual, weight, EPS)
    torch_out = add_rms_norm_torch(x_torch, residual, weight, EPS)
    dispatched_x = x.clone()
    dispatched = add_rms_norm(dispatched_x, residual, weight, EPS, KernelBackend.NATIVE)

    assert_close(out.double(), expected, TOL, seed)
    assert_close(out, torch_out, TOL, seed)
    assert_close(x_native.double(), stream, TOL, seed)  # the residual stream, updated in place
    assert_close(x_native, x_torch, 0.0, seed)
    assert_close(dispatched, out, 0.0, seed)
    assert_close(dispatched_x, x_native, 0.0, seed)


def test_add_rms_norm_rejects_bad_inputs(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 64, generator=gen)  # [tokens, hidden]
    weight = torch.randn(64, generator=gen)  # [hidden]
    with pytest.raises(ValueError, match="weight"):
        native.add_rms_norm(x, None, weight[:32], EPS)
    with pytest.raises(ValueError, match="residual"):
        native.add_rms_norm(x, x[:2], weight, EPS)
    with pytest.raises(ValueError, match="not be x itself"):
        native.add_rms_norm(x, x, weight, EPS)
    with pytest.raises(ValueError, match="contiguous"):
        native.add_rms_norm(x.t(), None, weight[:4], EPS)


# ---- SiLU·mul --------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1536, 37])
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_silu_mul_matches_reference_and_torch(native, width: int, num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_tokens, 2 * width, generator=gen) * 4  # [tokens, 2 I]; gates well past ±10 too
    gate_up[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0])  # saturated exponentials
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = gate * torch.sigmoid(gate) * up  # [tokens, I]

    out = native.silu_mul(gate_up)

    assert out.shape == (num_tokens, width)
    assert_close(out.double(), expected, TOL, seed)
    assert_close(out, silu_mul_torch(gate_up), TOL, seed)
    assert_close(silu_mul(gate_up, KernelBackend.NATIVE), out, 0.0, seed)


def test_silu_mul_reads_strided_rows(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(9, 2 * 40 + 8, generator=gen)  # [tokens, 2 I + 8]: rows 88 floats apart
    gate_up = wide[:, : 2 * 40]  # [tokens, 2 I], a strided view
    assert not gate_up.is_contiguous()
    assert_close(native.silu_mul(gate_up), native.silu_mul(gate_up.contiguous()), 0.0, seed)
    with pytest.raises(ValueError, match="gate_up"):
        native.silu_mul(wide[:, :7])  # an odd width cannot be gate then up


# ---- RoPE + K/V write ------------------------------------------------------------------------------

NUM_LAYERS = 3
LAYER = 1  # not 0, so a wrong layer offset writes another layer


def rope_tables(num_tokens: int, head_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = [cos, cos] and signed sin = [-sin, sin] of random angles, as engine/modeling/rope.py lays them out."""
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 100  # [tokens, D / 2]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # [tokens, D] each


def rope_reference(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's apply_rotary_pos_emb in float64: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    sin = torch.cat([signed_sin[:, half:], signed_sin[:, half:]], dim=-1)[:, None]  # [tokens, 1, D]
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [tokens, heads, D]
    return x * cos[:, None] + rotated_half * sin


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 48), (8, 2, 6)])
@pytest.mark.parametrize("num_tokens", [1, 45])
def test_rope_kv_write_matches_reference_and_torch(
    native, num_heads: int, num_kv_heads: int, head_dim: int, num_tokens: int, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    block_size = 16
    num_pages = num_tokens // block_size + 6
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen)  # [tokens, (heads + 2 kv) * D]
    cos, signed_sin = rope_tables(num_tokens, head_dim, gen)
    storage = torch.randn(num_pages, NUM_LAYERS, block_size * 2 * num_kv_heads * head_dim, generator=gen)
    slots = torch.tensor(rng.sample(range(num_pages * block_size), num_tokens))  # [tokens], distinct, scattered
    kv_rows = kv_row_index(slots, NUM_LAYERS, block_size)  # [tokens]

    q_heads, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    rotated = rope_reference(
        qkv[:, : q_heads + kv_width].double().view(num_tokens, -1, head_dim), cos.double(), signed_sin.double()
    ).view(num_tokens, -1)  # [tokens, (heads + kv) * D]
    expected_pool = storage.clone().double()
    layer_view = expected_pool[:, LAYER].view(num_pages, 2, block_size, kv_width)  # [pages, 2, bs, kv * D]
    for t, slot in enumerate(slots.tolist()):
        layer_view[slot // block_size, 0, slot % block_size] = rotated[t, q_heads:]
        layer_view[slot // block_size, 1, slot % block_size] = qkv[t, q_heads + kv_width :].double()

    qkv_native, pool_native = qkv.clone(), storage.clone()
    native.rope_kv_write(qkv_native, cos, signed_sin, pool_native, LAYER, kv_rows, num_heads, num_kv_heads)
    qkv_torch, pool_torch = qkv.clone(), storage.clone()
    rope_kv_write_torch(qkv_torch, cos, signed_sin, pool_torch, LAYER, kv_rows, num_heads, num_kv_heads)
    qkv_dispatched, pool_dispatched = qkv.clone(), storage.clone()
    rope_kv_write(
        qkv_dispatched, cos, signed_sin, pool_dispatched, LAYER, kv_rows, num_heads, num_kv_heads, KernelBackend.NATIVE
    )

    assert_close(qkv_native[:, : q_heads + kv_width].double(), rotated, TOL, seed)
    assert_close(qkv_native[:, q_heads + kv_width :], qkv[:, q_heads + kv_width :], 0.0, seed)  # v untouched
    assert_close(pool_native.double(), expected_pool, TOL, seed)  # and nothing else in the pool moved
    assert_close(qkv_native, qkv_torch, TOL, seed)
    assert_close(pool_native, pool_torch, TOL, seed)
    assert_close(qkv_dispatched, qkv_native, 0.0, seed)
    assert_close(pool_dispatched, pool_native, 0.0, seed)


def test_rope_kv_write_reads_strided_rows_and_rejects_bad_rows(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 5, 2, 1, 16, 16
    width = (num_heads + 2 * num_kv_heads) * head_dim
    wide = torch.randn(num_tokens, width + 16, generator=gen)  # [tokens, qkv + 16]: strided rows
    cos, signed_sin = rope_tables(num_tokens, head_dim, gen)
    storage = torch.randn(2, NUM_LAYERS, block_size * 2 * num_kv_heads * head_dim, generator=gen)
    kv_rows = kv_row_index(torch.arange(num_tokens), NUM_LAYERS, block_size)  # [tokens]

    dense, dense_pool = wide[:, :width].contiguous(), storage.clone()
    native.rope_kv_write(dense, cos, signed_sin, dense_pool, LAYER, kv_rows, num_heads, num_kv_heads)
    native.rope_kv_write(wide[:, :width], cos, signed_sin, storage, LAYER, kv_rows, num_heads, num_kv_heads)
    assert_close(wide[:, :width], dense, 0.0, seed)
    assert_close(storage, dense_pool, 0.0, seed)

    with pytest.raises(ValueError, match="outside the pool"):
        bad_rows = kv_rows.clone()
        bad_rows[2] = storage.numel()  # far past the last row
        native.rope_kv_write(dense, cos, signed_sin, storage, LAYER, bad_rows, num_heads, num_kv_heads)
    with pytest.raises(ValueError, match="layer"):
        native.rope_kv_write(dense, cos, signed_sin, storage, NUM_LAYERS, kv_rows, num_heads, num_kv_heads)
    with pytest.raises(ValueError, match="heads"):
        native.rope_kv_write(dense, cos, signed_sin, storage, LAYER, kv_rows, 3, num_kv_heads)
