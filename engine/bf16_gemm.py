"""Which native GEMM computes the bf16 and int8 projection weights on this machine, measured at load.

The native CPU kernels have two panel formats for bf16 and int8 weights: k-major panels widened to fp32
and run on fp32 FMAs (kernels/linear_packed.py, every build), and k-pair panels on AVX512-BF16's
``vdpbf16ps`` with the activations rounded to bf16 (kernels/linear_dot.py, AVX-512 builds on CPUs that
have it). The dot product does twice an FMA's arithmetic per instruction, so which is faster depends on
how fast the CPU issues it: reported about as fast as its FMAs on AMD Zen 4, at a quarter of their rate
(so half their products) on the Xeon measured in docs/precision.md. A full decode batch's projections are
bound by arithmetic, so the engine times both on the model's gate/up projection (its largest a layer) at
its full batch (``max_num_seqs`` rows), in a few short alternated repeats, and runs every projection on
the faster (``EngineConfig.bf16_gemm="auto"``); "widen" and "dot" pin one.
"""

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from kernels.backend import KernelBackend
from kernels.linear import DOT, WIDEN, LinearWeight, linear
from kernels.linear_dot import dot_available
from kernels.native_cpu import cpu_flags

logger = logging.getLogger(__name__)

AUTO = "auto"
BF16_GEMM_CHOICES = (AUTO, WIDEN, DOT)  # the first is the default
# A calibration: a warm-up call of each format, then rounds of one timed sample of each, the order
# alternating; a sample is the mean of a few calls (one call of gate/up at 64 rows takes ~1-3 ms on two
# cores). At least MIN_ROUNDS, then until MAX_ROUNDS or the time budget: well under half a second.
CALLS_PER_SAMPLE = 2
MIN_ROUNDS = 3
MAX_ROUNDS = 9
CALIBRATION_BUDGET_S = 0.3
CALIBRATION_SEED = 0
HOW = {WIDEN: "weights widened to fp32, fp32 FMAs", DOT: "vdpbf16ps on projection inputs rounded to bf16"}


@dataclass(frozen=True, slots=True)
class GemmChoice:
    """The GEMM of an engine's bf16 or int8 weights, and why."""

    gemm: str
    """"widen" (k-major panels, fp32 FMAs) or "dot" (k-pair panels, vdpbf16ps)."""
    reason: str
    """One clause for the precision's reason, with the measured times where it was measured."""


def choose_gemm(widen_s: Sequence[float], dot_s: Sequence[float], rows: int) -> GemmChoice:
    """The format with the lower median of its timed samples (seconds per call); a tie keeps "widen"."""
    widen, dot = statistics.median(widen_s), statistics.median(dot_s)
    gemm = DOT if dot < widen else WIDEN
    return GemmChoice(
        gemm,
        f"bf16 GEMM {gemm} ({HOW[gemm]}): dot tile {dot * 1e3:.2f} ms vs widened {widen * 1e3:.2f} ms at "
        f"{rows} rows, measured at load",
    )


def time_gemms(shape: tuple[int, int], rows: int, int8: bool) -> tuple[list[float], list[float]]:
    """Seconds per call of a projection of ``shape`` [out_features, in_features] on ``rows`` rows, in the
    widened and in the dot panels (bf16 weights, or int8 with ``int8``): alternated samples of each.

    The values are seeded random: the arithmetic takes the same time on any values of the same shape.
    """
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()  # [out, in]
    x = torch.randn(rows, in_features, generator=gen)  # [rows, in]
    quantization = "int8" if int8 else None
    formats = {
        gemm: LinearWeight.prepare(weight, None, KernelBackend.NATIVE, quantization, gemm) for gemm in (WIDEN, DOT)
    }
    samples: dict[str, list[float]] = {WIDEN: [], DOT: []}
    for prepared in formats.values():
        linear(x, prepared)  # warm: pages touched, scratch sized
    deadline = time.perf_counter() + CALIBRATION_BUDGET_S
    for round_index in range(MAX_ROUNDS):
        if round_index >= MIN_ROUNDS and time.perf_counter() > deadline:
            break
        order = (WIDEN, DOT) if round_index % 2 == 0 else (DOT, WIDEN)
        for gemm in order:
            started = time.perf_counter()
            for _ in range(CALLS_PER_SAMPLE):
                linear(x, formats[gemm])
            samples[gemm].append((time.perf_counter() - started) / CALLS_PER_SAMPLE)
    return samples[WIDEN], samples[DOT]


def resolve_bf16_gemm(
    setting: str,
    weight_format: str,
    device: torch.device,
    backend: KernelBackend,
    shape: tuple[int, int],
    rows: int,
) -> GemmChoice | None:
    """The GEMM of ``weight_format`` weights ("float32", "bfloat16" or "int8") under ``setting`` ("auto",
    "widen" or "dot"); None where there is no choice (fp32 weights, the torch kernels, CUDA). ``auto``
    measures both on ``shape`` at ``rows`` rows where the dot panels run here. ConfigError for "dot" on a CPU
    engine that cannot run it."""
    if setting not in BF16_GEMM_CHOICES:
        raise ConfigError(f"bf16_gemm must be one of {', '.join(BF16_GEMM_CHOICES)}, got {setting!r}")
    if device.type != "cpu":
        return None
    if setting == DOT and (backend is not KernelBackend.NATIVE or not dot_available()):
        raise ConfigError(f"bf16_gemm='dot' cannot be used: {_dot_unavailable_reason(backend)}; use 'auto' or 'widen'")
    if backend is not KernelBackend.NATIVE or weight_format == "float32":
        return None
    if setting != AUTO:
        return GemmChoice(setting, f"bf16 GEMM {setting} ({HOW[setting]}): bf16_gemm={setting} was asked for")
    if not dot_available():
        return GemmChoice(WIDEN, f"bf16 GEMM widen ({HOW[WIDEN]}): {_dot_unavailable_reason(backend)}")
    started = time.perf_counter()
    widen_s, dot_s = time_gemms(shape, rows, weight_format == "int8")
    choice = choose_gemm(widen_s, dot_s, rows)
    logger.info("%s (%d samples each, %.2f s)", choice.reason, len(widen_s), time.perf_counter() - started)
    return choice


def _dot_unavailable_reason(backend: KernelBackend) -> str:
    if backend is not KernelBackend.NATIVE:
        return f"the dot-product panels are the native CPU kernels' and the engine runs the {backend.value} kernels"
    if "avx512_bf16" not in cpu_flags().split():
        return "this CPU has no AVX512-BF16 dot products (no avx512_bf16 in /proc/cpuinfo)"
    return "the native kernels are built without AVX-512 and AVX512-BF16 (LORAPLEX_NATIVE_MARCH names another target)"
