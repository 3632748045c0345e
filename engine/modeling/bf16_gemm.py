"""Which native GEMM computes the bf16 and int8 projection weights on this machine, measured at load.

The native CPU kernels have two panel formats for each of bf16 and int8 weights: k-major panels widened
to fp32 and run on fp32 FMAs (loraplex_kernels/projection/linear_packed.py, every build), and the format's dot product
(AVX-512 builds on CPUs that have it): bf16 weights in k pairs on AVX512-BF16's ``vdpbf16ps`` with the
activations rounded to bf16, or on AMX tiles where the CPU has AMX-BF16 (loraplex_kernels/projection/linear_dot.py);
int8 weights in k quads on AVX512-VNNI's ``vpdpbusd`` with the activations quantized to int8 per block of 32
(loraplex_kernels/projection/linear_vnni.py). ``vdpbf16ps`` does twice an FMA's arithmetic per instruction and
``vpdpbusd`` four times, so which is faster depends on how fast the CPU issues them: ``vdpbf16ps`` is reported about as
fast as FMAs on AMD Zen 4 and runs at a quarter of their rate on the Xeons measured in docs/precision.md,
where ``vpdpbusd`` runs at their rate and AMX tiles (on the Xeon that has them) do about ten times the
FMAs' products a cycle. A full decode batch's projections are bound by arithmetic, so the engine times both
on the model's gate/up projection (its largest a layer) at its full batch (``max_num_seqs`` rows), in a few short
alternated repeats, and runs every projection on the faster (``EngineConfig.bf16_gemm="auto"``); "widen"
and "dot" pin one.
"""

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import cpu_flags
from loraplex_kernels.projection.linear import DOT, WIDEN, LinearWeight, linear
from loraplex_kernels.projection.linear_dot import amx_available, dot_available
from loraplex_kernels.projection.linear_vnni import vnni_available

logger = logging.getLogger(__name__)

AUTO = "auto"
BF16_GEMM_CHOICES = (AUTO, WIDEN, DOT)  # the first is the default
# A calibration: a warm-up call of each format, then rounds of one timed sample of each, the order
# alternating; a sample is the mean of a few calls of gate/up at max_num_seqs rows. At least MIN_ROUNDS,
# then until MAX_ROUNDS or the time budget, so the calibration stays well under half a second.
CALLS_PER_SAMPLE = 2
MIN_ROUNDS = 3
MAX_ROUNDS = 9
CALIBRATION_BUDGET_S = 0.3
CALIBRATION_SEED = 0
WIDENED = "weights widened to fp32, fp32 FMAs"
BF16_DOT = "vdpbf16ps on projection inputs rounded to bf16"
BF16_AMX = "AMX tiles (tdpbf16ps) on projection inputs rounded to bf16"
HOW = {
    "bfloat16": {WIDEN: WIDENED, DOT: BF16_DOT},
    "int8": {WIDEN: WIDENED, DOT: "vpdpbusd on projection inputs quantized to int8 per block of 32"},
}


@dataclass(frozen=True, slots=True)
class GemmChoice:
    """The GEMM of an engine's bf16 or int8 weights, and why."""

    gemm: str
    """"widen" (k-major panels, fp32 FMAs) or "dot" (the weight format's dot product: bf16 k-pair panels
    on vdpbf16ps, int8 k-quad panels on vpdpbusd)."""
    reason: str
    """One clause for the precision's reason, with the measured times where it was measured."""


def choose_gemm(widen_s: Sequence[float], dot_s: Sequence[float], rows: int, weight_format: str) -> GemmChoice:
    """The format with the lower median of its timed samples (seconds per call); a tie keeps "widen"."""
    widen, dot = statistics.median(widen_s), statistics.median(dot_s)
    gemm = DOT if dot < widen else WIDEN
    return GemmChoice(
        gemm,
        f"{_label(weight_format)} GEMM {gemm} ({_how(weight_format, gemm)}): dot tile {dot * 1e3:.2f} ms vs "
        f"widened {widen * 1e3:.2f} ms at {rows} rows, measured at load",
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
    int8 = weight_format == "int8"
    if setting == DOT and (backend is not KernelBackend.NATIVE or not dot_runs(weight_format)):
        raise ConfigError(
            f"bf16_gemm='dot' cannot be used: {_dot_unavailable_reason(backend, int8)}; use 'auto' or 'widen'"
        )
    if backend is not KernelBackend.NATIVE or weight_format == "float32":
        return None
    label = _label(weight_format)
    if setting != AUTO:
        how = _how(weight_format, setting)
        return GemmChoice(setting, f"{label} GEMM {setting} ({how}): bf16_gemm={setting} was asked for")
    if not dot_runs(weight_format):
        how = _how(weight_format, WIDEN)
        return GemmChoice(WIDEN, f"{label} GEMM widen ({how}): {_dot_unavailable_reason(backend, int8)}")
    started = time.perf_counter()
    widen_s, dot_s = time_gemms(shape, rows, int8)
    choice = choose_gemm(widen_s, dot_s, rows, weight_format)
    logger.info("%s (%d samples each, %.2f s)", choice.reason, len(widen_s), time.perf_counter() - started)
    return choice


def _how(weight_format: str, gemm: str) -> str:
    """How ``gemm`` computes ``weight_format`` weights here (bf16's dot GEMM is AMX's where it runs)."""
    if weight_format == "bfloat16" and gemm == DOT and amx_available():
        return BF16_AMX
    return HOW[weight_format][gemm]


def _label(weight_format: str) -> str:
    return "int8" if weight_format == "int8" else "bf16"


def dot_runs(weight_format: str) -> bool:
    """Whether the native dot-product panels of ``weight_format`` weights run here (int8: AVX512-VNNI's;
    bf16, and float32 whose setting is checked alike: AVX512-BF16's or AMX's)."""
    return vnni_available() if weight_format == "int8" else dot_available() or amx_available()


def _dot_unavailable_reason(backend: KernelBackend, int8: bool) -> str:
    if backend is not KernelBackend.NATIVE:
        return f"the dot-product panels are the native CPU kernels' and the engine runs the {backend.value} kernels"
    name, flag = ("AVX512-VNNI", "avx512_vnni") if int8 else ("AVX512-BF16", "avx512_bf16")
    if flag not in cpu_flags().split():
        return f"this CPU has no {name} dot products (no {flag} in /proc/cpuinfo)"
    return f"the native kernels are built without AVX-512 and {name} (LORAPLEX_NATIVE_MARCH names another target)"
