"""The engine's storage formats against float32, as ``loraplex doctor`` checks them on a CPU: a projection (and
the gate/up projection with SiLU·mul) on bf16 and int8 weights, attention and the K/V write on bf16 K/V pages,
and the SGMV on bf16 adapter rows, each against the same op on float32 values (the unrounded weights, K/V or
adapter rows) within a tolerance the format's rounding sets. The ops and the error measure come
from :mod:`loraplex_kernels.op_checks`.
"""

import torch
import torch.nn.functional as F

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.layer_ops.silu_mul import silu_mul_torch
from loraplex_kernels.op_checks import OPS, SEED, TOLERANCES, CheckTarget, OpCheck, pairs_error
from loraplex_kernels.projection.linear import WIDEN, LinearWeight, linear, linear_silu_mul

# A projection on bf16 or int8 weights against the same projection on the float32 weights: the weights'
# rounding (bf16 keeps 8 bits of mantissa, int8 steps of 1/127 of a row's largest magnitude), on unit-scale
# inputs and weights of 1/10 (measured on the Xeon: 1.2e-3 and 4.4e-3).
WEIGHT_FORMAT_TOLERANCES = {"bfloat16": 1e-2, "int8": 3e-2}
# Attention over bf16 K/V pages and the K/V write into them, against both on float32 pages: the K/V's
# rounding to bf16 (a written value is off by at most 2^-9 of itself) on unit-scale inputs (measured on the
# Xeon: 2.5e-3 for the write, 2.7e-3 for attention; an attention 1 % off measures 7.3e-3).
KV_FORMAT_TOLERANCES = {"bfloat16": 5e-3}
# The fused SGMV over bf16 adapter rows in the pool, against the same over the unrounded float32 rows: the
# rows' rounding (each element off by at most 2^-9 of itself) on unit-scale x, v and y (measured on the Xeon:
# 1.8e-3; the op's output 1 % off measures 7.7e-3, its delta alone 1 % off 6.5e-3).
ADAPTER_FORMAT_TOLERANCES = {"bfloat16": 5e-3}


def run_weight_format_check(
    weight_format: str, activation_dtype: torch.dtype, backend: KernelBackend, bf16_gemm: str = WIDEN
) -> OpCheck:
    """A projection, and the gated MLP's gate/up projection with SiLU·mul (fused where the GEMM fuses them),
    on ``weight_format`` ("bfloat16" or "int8") weights as the engine prepares them for ``backend`` on the
    CPU (on ``bf16_gemm``'s native panels), inputs in ``activation_dtype``, against ``F.linear`` on the
    float32 weights: the larger error of the two."""
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(9, 96, generator=gen)  # [tokens, in]
    weight, bias = torch.randn(100, 96, generator=gen) / 10, torch.randn(100, generator=gen)  # [out, in], [out]
    gate_up = torch.randn(2 * 48, 96, generator=gen) / 10  # [2 * intermediate, in]: whole AMX column blocks
    quantization = "int8" if weight_format == "int8" else None
    stored_dtype = torch.bfloat16 if weight_format == "bfloat16" else activation_dtype

    def prepare(w: torch.Tensor, b: torch.Tensor | None) -> LinearWeight:
        return LinearWeight.prepare(w.to(stored_dtype), b, backend, quantization, bf16_gemm)

    xa = x.to(activation_dtype)
    projection = linear(xa, prepare(weight, bias.to(activation_dtype)))  # [tokens, out]
    activation = linear_silu_mul(xa, prepare(gate_up, None), backend)  # [tokens, intermediate]
    error = pairs_error([(projection, F.linear(x, weight, bias)), (activation, silu_mul_torch(F.linear(x, gate_up)))])
    tolerance = max(WEIGHT_FORMAT_TOLERANCES[weight_format], TOLERANCES[activation_dtype])
    return OpCheck(f"linear_{weight_format}", error, tolerance)


def run_kv_format_check(kv_format: str, backend: KernelBackend) -> OpCheck:
    """Paged attention over ``kv_format`` ("bfloat16") K/V pages and the K/V write into them, with ``backend``
    on the CPU in float32 activations, against both on float32 pages holding the unrounded K/V."""
    target = _pool_target(kv_format, backend)
    pairs = OPS["paged_attention"](target) + OPS["rope_kv_write"](target)
    error = pairs_error(pairs)
    return OpCheck(f"kv_{kv_format}", error, KV_FORMAT_TOLERANCES[kv_format])


def run_adapter_format_check(adapter_format: str, backend: KernelBackend) -> OpCheck:
    """The fused SGMV over ``adapter_format`` ("bfloat16") adapter rows in the pool, with ``backend`` on the
    CPU in float32 activations, against the torch op over float32 rows holding the unrounded adapters."""
    pairs = OPS["sgmv_fused"](_pool_target(adapter_format, backend))
    error = pairs_error(pairs)
    return OpCheck(f"adapters_{adapter_format}", error, ADAPTER_FORMAT_TOLERANCES[adapter_format])


def _pool_target(pool_format: str, backend: KernelBackend) -> CheckTarget:
    """float32 activations on the CPU beside a pool in ``pool_format``, seeded as every check is."""
    generator = torch.Generator().manual_seed(SEED)
    return CheckTarget(torch.device("cpu"), torch.float32, backend, generator, getattr(torch, pool_format))
