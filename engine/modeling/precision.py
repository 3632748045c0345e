"""The engine's precision: the dtypes of its activations, K/V and adapters, and the format of its projection weights.

``EngineConfig.dtype`` names the model's precision and ``EngineConfig.quantization`` the projections'
8-bit form; this module resolves the two, with the kernel backend, into what the engine runs and why:

- On CUDA and on the torch kernels, ``bfloat16`` is the dtype of everything but the fp32 accumulations,
  softmax, norms and logits: weights, activations, K/V and adapters in the pool.
- On the native CPU kernels, ``bfloat16`` is the projections' weight format (bf16 panels widened in
  registers, fp32 accumulation) and the dtype of the pool, K/V and adapters alike: K/V rounded to nearest
  even as they are written and widened as attention reads them (scores, softmax and accumulation fp32),
  adapters rounded once when their pages are packed and widened as the SGMV op reads them (fp32 sums). So
  a GiB of pool holds twice the tokens or twice the adapters, and a decode step streams half the K/V and
  adapter bytes. Activations and the glue ops stay fp32.
- ``quantization="int8"``: per-output-row symmetric int8 projection weights, quantized at load; the
  activations in the model's dtype between ops (the VNNI GEMM quantizes each projection's input per block
  of 32 for its dot products), adapters unquantized. The embedding and norms keep the model's dtype.
- ``auto``: bf16 on CUDA; on CPU bf16 where the CPU computes it natively (AVX512-BF16 or AMX), fp32
  elsewhere.
- On the native CPU kernels, bf16 and int8 weights run on one of two GEMMs, k-major panels widened to fp32
  or the format's dot products (bf16: AVX512-BF16's, int8: AVX512-VNNI's), measured at load where the CPU
  has both (engine/modeling/bf16_gemm.py); the choice and its measured reason join the precision's.
"""

import logging
from dataclasses import dataclass, replace
from functools import cache

import torch

from engine.errors import ConfigError
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import cpu_flags

logger = logging.getLogger(__name__)

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs that compute bf16 natively
QUANTIZATIONS = ("int8",)


@dataclass(frozen=True, slots=True)
class Precision:
    """What the engine computes in, resolved once."""

    dtype: torch.dtype
    """The model's dtype as asked for (or as ``auto`` chose): what the weights are loaded in."""
    activation_dtype: torch.dtype
    """Activations: ``dtype``, or fp32 on the native CPU kernels."""
    kv_dtype: torch.dtype
    """The pool's dtype, K/V and adapters alike: ``activation_dtype``, or bf16 on the native CPU kernels when
    ``dtype`` is bf16."""
    quantization: str | None
    """"int8" for int8 projection weights, else None."""
    reason: str
    """Why: one sentence for the logs, metrics and ``loraplex doctor``."""
    bf16_gemm: str | None = None
    """The native GEMM of bf16 and int8 weights, "widen" or "dot" (engine/modeling/bf16_gemm.py); None where there is
    no choice (fp32 weights, the torch kernels, CUDA)."""

    def with_gemm(self, gemm: str, why: str) -> "Precision":
        """This precision with bf16 and int8 weights on ``gemm``, ``why`` added to the reason."""
        return replace(self, bf16_gemm=gemm, reason=f"{self.reason}; {why}")

    @property
    def weight_format(self) -> str:
        """The projections' weights as stored: "int8", "bfloat16" or "float32"."""
        return self.quantization or dtype_name(self.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@cache
def cpu_computes_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16)."""
    flags = set(cpu_flags().split())
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def requested_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The model dtype ``dtype`` ("auto", "float32", "bfloat16", "float16") names on ``device``, and why."""
    if dtype != "auto":
        return getattr(torch, dtype), f"dtype={dtype} was asked for"
    if device.type == "cuda":
        return torch.bfloat16, "auto: bfloat16 on CUDA"
    if cpu_computes_bf16():
        return torch.bfloat16, "auto: this CPU computes bf16 natively (avx512_bf16/amx_bf16)"
    return torch.float32, "auto: this CPU has no bf16 instructions (no avx512_bf16/amx_bf16), so float32"


def resolve_precision(
    dtype: torch.dtype, why: str, quantization: str | None, device: torch.device, backend: KernelBackend
) -> Precision:
    """The precision an engine of model dtype ``dtype`` runs with ``backend`` on ``device``."""
    if quantization is not None and device.type != "cpu":
        raise ConfigError(f"quantization={quantization!r} runs on CPU only; the engine runs on {device.type}")
    if backend is KernelBackend.NATIVE:
        activation = torch.float32
        kv = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        how = "; the native CPU kernels keep activations in float32"
    else:
        activation = kv = dtype
        how = ""
    weights = f"{quantization} weights" if quantization else f"{dtype_name(dtype)} weights"
    reason = f"{why}: {weights}, {dtype_name(kv)} K/V and adapters, {dtype_name(activation)} activations{how}"
    return Precision(dtype, activation, kv, quantization, reason)
