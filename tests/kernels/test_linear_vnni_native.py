"""The native int8 dot-product panels (k in quads, activations quantized per row and block of 32, vpdpbusd)
against a float64 reference of the same quantized arithmetic: row counts on both sides of the tile size and
of a pass, in_features off the block size, partial last panels, bias, batch invariance, bad inputs; and
where they cannot run, that the engine keeps the widened panels (the AVX2 build runs this file too)."""

import os

import pytest
import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from engine.modeling.bf16_gemm import resolve_bf16_gemm
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import MARCH_ENV, cpu_flags
from loraplex_kernels.projection.linear import DOT, WIDEN, LinearWeight, WeightLayout, linear, quantize_int8
from loraplex_kernels.projection.linear_vnni import (
    BLOCK,
    linear_vnni,
    pack_linear_quads,
    quantize_blocks,
    vnni_available,
)
from tests.kernels.scaled_error import assert_scaled_close

CPU = torch.device("cpu")
needs_vnni = pytest.mark.skipif(
    "avx512_vnni" not in cpu_flags().split() or os.environ.get(MARCH_ENV) is not None,
    reason="the int8 dot-product panels need a CPU with avx512_vnni and the library built for it",
)


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The quantized arithmetic in float64: x quantized per row and block, exact block sums, scaled: [rows, out]."""
    xq, xs = quantize_blocks(x)  # [rows, blocks * 32] int8, [rows, blocks]
    rows, blocks = xs.shape
    wq = F.pad(q, (0, blocks * BLOCK - q.shape[1])).double().view(q.shape[0], blocks, BLOCK)  # [out, blocks, 32]
    block_sums = torch.einsum("tbk,obk->tob", xq.double().view(rows, blocks, BLOCK), wq)  # [rows, out, blocks]
    y = (block_sums * xs.double()[:, None, :]).sum(dim=2) * scales.double()  # [rows, out]
    return y if bias is None else y + bias.double()


def test_quad_panels_hold_k_in_quads_and_block_offsets(native):
    width = native.linear_panel_width()
    weight = ((torch.arange((width + 5) * 35) % 200) - 100).reshape(width + 5, 35).to(torch.int8)  # [out, in=35]
    packed, offsets = pack_linear_quads(weight)  # [2, 16, 4 * width], [2, 2, width]
    assert packed.shape == (2, 2 * BLOCK // 4, 4 * width) and packed.dtype == torch.int8
    assert offsets.shape == (2, 2, width) and offsets.dtype == torch.int32
    for out in range(width + 5):
        panel, column = packed[out // width], out % width
        assert torch.equal(panel[:, 4 * column : 4 * column + 4].reshape(-1)[:35], weight[out])
        assert not panel[:, 4 * column : 4 * column + 4].reshape(-1)[35:].any()  # k past in_features
        sums = [weight[out, :BLOCK].int().sum(), weight[out, BLOCK:].int().sum()]
        assert offsets[out // width, :, column].tolist() == [-128 * int(s) for s in sums]
    assert not packed[1, :, 20:].any() and not offsets[1, :, 5:].any()  # columns past out_features
    with pytest.raises(ValueError, match="int8"):
        pack_linear_quads(weight.float())


def test_blocks_quantize_to_nearest_with_one_scale_a_row_and_block():
    x = torch.tensor([[0.0] * 40, [1.0, -0.5, 0.25, *([0.0] * 37)], [*([0.0] * 32), 2.54, -1.27, *([0.0] * 6)]])
    q, scales = quantize_blocks(x)  # [3, 64], [3, 2]
    assert q.shape == (3, 64) and scales.shape == (3, 2)
    assert not q[0].any() and scales[0].tolist() == [0.0, 0.0]
    assert q[1, :3].tolist() == [127, -64, 32]  # -63.5 and 31.75 to nearest (ties to even)
    assert q[2, 32:34].tolist() == [127, -64] and q[2, :32].abs().sum() == 0  # -63.5 -> -64
    assert torch.allclose(scales[2], torch.tensor([0.0, 2.54 / 127]))


@needs_vnni
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 64, 129])  # tiles of 4, passes of 128
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (37, 50), (16, 1)])
def test_vnni_panels_match_float64_on_the_quantized_inputs(
    native, rows: int, in_features: int, out_features: int, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)  # [rows, in]
    if rows > 2:
        x[1] = 0.0  # a row of zeros: zero scales
        x[2, : min(in_features, BLOCK)] *= 100.0  # one block far larger than the others
    q, scales = quantize_int8(torch.randn(out_features, in_features, generator=gen) / in_features**0.5)
    bias = torch.randn(out_features, generator=gen) if rows % 2 else None  # [out], on odd row counts
    packed, offsets = pack_linear_quads(q)
    actual = linear_vnni(x, packed, offsets, bias, out_features, scales)  # [rows, out]
    assert_scaled_close(actual, reference(x, q, scales, bias), seed)


@needs_vnni
def test_a_row_with_a_nan_or_an_infinity_gives_nans_and_leaves_the_others_alone(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 100, generator=gen)  # [rows, in]
    x[1, 40], x[3, 99], x[4, 0] = float("nan"), float("inf"), float("-inf")
    q, scales = quantize_int8(torch.randn(70, 100, generator=gen) / 10)  # [out, in]
    packed, offsets = pack_linear_quads(q)
    y = linear_vnni(x, packed, offsets, None, 70, scales)  # [6, out]
    assert torch.isnan(y[[1, 3, 4]]).all(), f"seed={seed}"
    finite = [0, 2, 5]
    assert_scaled_close(y[finite], reference(x[finite], q, scales, None), seed)
    xq, xs = quantize_blocks(x)
    assert torch.isnan(xs[1, 1]) and not xq[1, 32:64].any() and not torch.isnan(xs[1, [0, 2, 3]]).any()


@needs_vnni
def test_a_rows_result_is_the_same_bits_in_any_batch(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 577, generator=gen)  # [300, in]: in_features off the block, passes of 128 and a partial one
    q, scales = quantize_int8(torch.randn(1000, 577, generator=gen) / 24)  # [out, in]
    bias = torch.randn(1000, generator=gen)
    packed, offsets = pack_linear_quads(q)
    alone = torch.cat([linear_vnni(x[i : i + 1], packed, offsets, bias, 1000, scales) for i in (0, 5, 299)])
    for batch in (x[:4], x[:6], x[:64], x):  # one tile, a tile and a tail, many, passes
        together = linear_vnni(batch, packed, offsets, bias, 1000, scales)  # [rows, out]
        assert torch.equal(together[0], alone[0]), f"seed={seed}"
        if batch.shape[0] > 5:
            assert torch.equal(together[5], alone[1]), f"seed={seed}"
    assert torch.equal(linear_vnni(x, packed, offsets, bias, 1000, scales)[299], alone[2]), f"seed={seed}"


@needs_vnni
def test_strided_rows(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(70, 700, generator=gen)  # rows of 700 floats, of which 576 are x's
    q, scales = quantize_int8(torch.randn(960, 576, generator=gen) / 24)  # [out, in]
    packed, offsets = pack_linear_quads(q)
    for x in (wide[:, :576], wide[::3, 100:676]):
        actual = linear_vnni(x, packed, offsets, None, 960, scales)
        assert_scaled_close(actual, reference(x.contiguous(), q, scales, None), seed)


@needs_vnni
def test_bad_inputs_are_refused(native):
    q, scales = quantize_int8(torch.randn(100, 64))
    packed, offsets = pack_linear_quads(q)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="float32"):
        linear_vnni(x.double(), packed, offsets, None, 100, scales)
    with pytest.raises(ValueError, match="features"):
        linear_vnni(torch.randn(4, 100), packed, offsets, None, 100, scales)
    with pytest.raises(ValueError, match="does not match"):
        linear_vnni(x, packed, offsets, None, 200, scales)
    with pytest.raises(ValueError, match="pack_linear_quads"):
        linear_vnni(x, native.pack_linear_weight(q), offsets, None, 100, scales)
    with pytest.raises(ValueError, match="pack_linear_quads"):
        linear_vnni(x, packed, offsets[:, :1], None, 100, scales)
    with pytest.raises(ValueError, match="scales"):
        linear_vnni(x, packed, offsets, None, 100, scales[:99])
    with pytest.raises(ValueError, match="bias"):
        linear_vnni(x, packed, offsets, torch.randn(99), 100, scales)


@needs_vnni
def test_linear_weight_takes_the_vnni_panels_for_int8_when_asked(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight, bias = (torch.randn(200, 96, generator=gen) / 10).bfloat16(), torch.randn(200, generator=gen)
    x = torch.randn(33, 96, generator=gen)
    prepared = LinearWeight.prepare(weight, bias.bfloat16(), KernelBackend.NATIVE, "int8", DOT)
    assert prepared.layout is WeightLayout.NATIVE_VNNI and prepared.weight.dtype == torch.int8
    assert prepared.weight_bytes == prepared.weight.numel() + 4 * (prepared.scales.numel() + prepared.offsets.numel())
    q, scales = quantize_int8(weight)
    assert_scaled_close(linear(x, prepared), reference(x, q, scales, bias.bfloat16().float()), seed)


def test_the_vnni_panels_run_exactly_where_the_build_and_cpu_have_avx512_vnni(native):
    built_for_this_cpu = os.environ.get(MARCH_ENV) is None
    assert vnni_available() == (built_for_this_cpu and "avx512_vnni" in cpu_flags().split())
    if not vnni_available():
        q, scales = quantize_int8(torch.randn(100, 64))
        packed, offsets = pack_linear_quads(q)
        with pytest.raises(ValueError, match="no AVX512-VNNI dot products here"):
            linear_vnni(torch.randn(4, 64), packed, offsets, None, 100, scales)


def test_auto_keeps_the_widened_int8_panels_where_the_vnni_panels_cannot_run(native):
    if vnni_available():
        pytest.skip("this build runs the int8 dot-product panels (the AVX2 build's run of this file tests the rest)")
    choice = resolve_bf16_gemm("auto", "int8", CPU, KernelBackend.NATIVE, (3072, 576), 64)
    assert choice is not None and choice.gemm == WIDEN
    assert choice.reason.startswith("int8 GEMM widen") and "AVX512-VNNI" in choice.reason
    with pytest.raises(ConfigError, match=r"bf16_gemm='dot' cannot be used.*AVX512-VNNI"):
        resolve_bf16_gemm("dot", "int8", CPU, KernelBackend.NATIVE, (3072, 576), 64)
