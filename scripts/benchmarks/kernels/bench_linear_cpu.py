"""The native GEMMs of bf16 and int8 weights side by side: k-major panels widened to fp32 against the
dot-product panels (bf16: AVX512-BF16's, and AMX tiles on the same panels; int8: AVX512-VNNI's), on the
model's projection shapes, with oneDNN's packed bf16 linear on bf16 activations (what torch and vLLM-CPU run)
as the peer. A format whose instructions this CPU (or build) lacks is left out.

One pass is every projection of ``--layers`` layers of the model (q/k/v, o, gate/up, down: the default
model's 960x576, 576x576, 3072x576, 576x1536) on ``rows`` rows, with random weights of those shapes in each
format (fp32 panels beside them as the yardstick). For each row count and thread count the formats run in
turn for ``--rounds`` rounds (A/B alternated, so a load that comes and goes falls on each alike) and each
one's median wall time of a pass is reported, with its CPU time (robust to a machine shared with other work).

``--noise-hz`` runs every pass a second time beside a process that wakes that many times a second and spins
``--noise-us`` each time (``cpu_noise.py``: what another process's wake-ups cost a GEMM that uses every core),
quiet and noisy passes alternated, and reports ``..._noisy_ms`` and ``..._noise_cost`` (noisy ÷ quiet).

    python -m scripts.benchmarks.kernels.bench_linear_cpu --json          # last line: one JSON object
    python -m scripts.benchmarks.kernels.bench_linear_cpu --rows 64 --threads 1 --formats bf16_widen bf16_dot
    python -m scripts.benchmarks.kernels.bench_linear_cpu --rows 64 --threads 2 --formats fp32 --noise-hz 700 --json
"""

import argparse
import contextlib
import dataclasses
import json
import logging
import statistics
import sys
import time

import torch

from app.model_store import resolve_model
from app.settings import Settings
from engine.config import ModelConfig
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.projection.linear import DOT, WIDEN, LinearWeight, WeightLayout, linear
from loraplex_kernels.projection.linear_dot import amx_available, dot_available
from loraplex_kernels.projection.linear_vnni import vnni_available
from scripts.benchmarks.kernels.cpu_noise import CpuNoise

logger = logging.getLogger("bench_linear_cpu")

FORMATS = {  # name: (weight dtype, quantization, GEMM, layout: the bf16 pair panels' GEMM named, else None)
    "fp32": (torch.float32, None, WIDEN, None),
    "bf16_onednn": (torch.bfloat16, None, WIDEN, WeightLayout.ONEDNN),  # oneDNN's packed bf16 linear, bf16 input
    "bf16_widen": (torch.bfloat16, None, WIDEN, None),
    "bf16_dot": (torch.bfloat16, None, DOT, WeightLayout.NATIVE_DOT),  # vdpbf16ps
    "bf16_amx": (torch.bfloat16, None, DOT, WeightLayout.NATIVE_AMX),
    "int8_widen": (torch.bfloat16, "int8", WIDEN, None),
    "int8_dot": (torch.bfloat16, "int8", DOT, None),
}


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """[out_features, in_features] of one layer's projections."""
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [
        (q_out + 2 * kv_out, cfg.hidden_size),
        (cfg.hidden_size, q_out),
        (2 * cfg.intermediate_size, cfg.hidden_size),
        (cfg.hidden_size, cfg.intermediate_size),
    ]


def prepare(name: str, shapes: list[tuple[int, int]], num_layers: int, seed: int) -> list[tuple[int, LinearWeight]]:
    """Every projection of ``num_layers`` layers in format ``name``, with its in_features."""
    dtype, quantization, gemm, layout = FORMATS[name]
    gen = torch.Generator().manual_seed(seed)
    weights = []
    for _ in range(num_layers):
        for out_features, in_features in shapes:
            weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5  # [out, in]
            backend = KernelBackend.TORCH if layout is WeightLayout.ONEDNN else KernelBackend.NATIVE
            prepared = LinearWeight.prepare(weight.to(dtype), None, backend, quantization, gemm)
            if layout in (WeightLayout.NATIVE_DOT, WeightLayout.NATIVE_AMX):  # the pair panels on the GEMM named
                prepared = dataclasses.replace(prepared, layout=layout)
            weights.append((in_features, prepared))
    return weights


def run(args: argparse.Namespace, noise: CpuNoise | None) -> dict:
    settings = Settings.from_env()
    cfg = ModelConfig.from_folder(args.model or resolve_model(settings.model, settings.home))
    shapes = projection_shapes(cfg)
    runs = {"bf16_dot": dot_available(), "bf16_amx": amx_available(), "int8_dot": vnni_available()}
    names = [name for name in args.formats if runs.get(name, True)]
    formats = {name: prepare(name, shapes, args.layers, args.seed) for name in names}
    result: dict = {"layers": args.layers, "rounds": args.rounds, "shapes": shapes, "formats": names}
    settings_of_noise = [False, True] if noise is not None else [False]
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            gen = torch.Generator().manual_seed(args.seed + rows)
            by_features = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}  # [rows, k]
            inputs = {name: {k: x.to(input_dtype(name)) for k, x in by_features.items()} for name in names}
            walls: dict[tuple[str, bool], list[float]] = {(name, n): [] for name in names for n in settings_of_noise}
            cpus: dict[tuple[str, bool], list[float]] = {key: [] for key in walls}
            for name in names:  # warm: pages touched, scratch sized
                run_pass(formats[name], inputs[name])
            for round_index in range(args.rounds):
                order = names if round_index % 2 == 0 else names[::-1]
                for noisy in settings_of_noise if round_index % 2 == 0 else settings_of_noise[::-1]:
                    if noise is not None:
                        noise.switch(noisy)
                        time.sleep(0.1)  # the noise process has woken (or gone quiet)
                    for name in order:
                        wall, cpu = run_pass(formats[name], inputs[name])
                        walls[name, noisy].append(wall)
                        cpus[name, noisy].append(cpu)
            if noise is not None:
                noise.switch(False)
            for name in names:
                key = f"{name}_rows{rows}_threads{threads}"
                result[f"{key}_ms"] = round(statistics.median(walls[name, False]) * 1e3, 2)
                result[f"{key}_cpu_ms"] = round(statistics.median(cpus[name, False]) * 1e3, 2)
                if noise is not None:
                    result[f"{key}_noisy_ms"] = round(statistics.median(walls[name, True]) * 1e3, 2)
                    result[f"{key}_noise_cost"] = round(result[f"{key}_noisy_ms"] / result[f"{key}_ms"], 3)
            logger.info(
                "%d rows, %d threads: %s",
                rows,
                threads,
                ", ".join(f"{name} {result[f'{name}_rows{rows}_threads{threads}_ms']:.2f} ms" for name in names),
            )
    return result


def input_dtype(name: str) -> torch.dtype:
    """The activations' dtype of format ``name``: bf16 for oneDNN's bf16 linear, fp32 for the native GEMMs."""
    return torch.bfloat16 if FORMATS[name][3] is WeightLayout.ONEDNN else torch.float32


def run_pass(weights: list[tuple[int, LinearWeight]], by_features: dict[int, torch.Tensor]) -> tuple[float, float]:
    """Wall and CPU seconds of every projection once, each on the rows of its in_features."""
    wall, cpu = time.perf_counter(), time.process_time()
    for in_features, weight in weights:
        linear(by_features[in_features], weight)
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the data folder's default model)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise-hz", type=float, default=0, help="also run beside wake-ups at this rate (0: off)")
    parser.add_argument("--noise-us", type=float, default=30, help="the spin of each wake-up, in microseconds")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    if args.noise_hz < 0 or args.noise_us <= 0:
        parser.error("--noise-hz must be 0 or more and --noise-us positive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    with CpuNoise(args.noise_hz, args.noise_us) if args.noise_hz else contextlib.nullcontext() as noise:
        result = run(args, noise)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
