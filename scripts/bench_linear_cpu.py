"""The native GEMMs of bf16 and int8 weights side by side: k-major panels widened to fp32 against the
AVX512-BF16 dot-product panels, on the model's projection shapes.

One pass is every projection of ``--layers`` layers of the model (q/k/v, o, gate/up, down: the default
model's 960x576, 576x576, 3072x576, 576x1536) on ``rows`` rows, with random weights of those shapes in each
format (fp32 panels beside them as the yardstick). For each row count and thread count the formats run in
turn for ``--rounds`` rounds (A/B alternated, so a load that comes and goes falls on each alike) and each
one's median wall time of a pass is reported, with its CPU time (robust to a machine shared with other work).

    python scripts/bench_linear_cpu.py --json          # last line: one JSON object
    python scripts/bench_linear_cpu.py --rows 64 --threads 1 --formats bf16_widen bf16_dot
"""

import argparse
import json
import logging
import statistics
import sys
import time

import torch

from app.model_store import resolve_model
from app.settings import Settings
from engine.config import ModelConfig
from kernels.backend import KernelBackend
from kernels.linear import DOT, WIDEN, LinearWeight, linear
from kernels.linear_dot import dot_available

logger = logging.getLogger("bench_linear_cpu")

FORMATS = {  # name: (weight dtype, quantization, GEMM)
    "fp32": (torch.float32, None, WIDEN),
    "bf16_widen": (torch.bfloat16, None, WIDEN),
    "bf16_dot": (torch.bfloat16, None, DOT),
    "int8_widen": (torch.bfloat16, "int8", WIDEN),
    "int8_dot": (torch.bfloat16, "int8", DOT),
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
    dtype, quantization, gemm = FORMATS[name]
    gen = torch.Generator().manual_seed(seed)
    weights = []
    for _ in range(num_layers):
        for out_features, in_features in shapes:
            weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5  # [out, in]
            prepared = LinearWeight.prepare(weight.to(dtype), None, KernelBackend.NATIVE, quantization, gemm)
            weights.append((in_features, prepared))
    return weights


def run(args: argparse.Namespace) -> dict:
    settings = Settings.from_env()
    cfg = ModelConfig.from_folder(args.model or resolve_model(settings.model, settings.home))
    shapes = projection_shapes(cfg)
    names = [name for name in args.formats if dot_available() or not name.endswith("_dot")]
    formats = {name: prepare(name, shapes, args.layers, args.seed) for name in names}
    result: dict = {"layers": args.layers, "rounds": args.rounds, "shapes": shapes, "formats": names}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            gen = torch.Generator().manual_seed(args.seed + rows)
            by_features = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}  # [rows, k]
            walls: dict[str, list[float]] = {name: [] for name in names}
            cpus: dict[str, list[float]] = {name: [] for name in names}
            for name in names:  # warm: pages touched, scratch sized
                run_pass(formats[name], by_features)
            for round_index in range(args.rounds):
                order = names if round_index % 2 == 0 else names[::-1]
                for name in order:
                    wall, cpu = run_pass(formats[name], by_features)
                    walls[name].append(wall)
                    cpus[name].append(cpu)
            for name in names:
                key = f"{name}_rows{rows}_threads{threads}"
                result[f"{key}_ms"] = round(statistics.median(walls[name]) * 1e3, 2)
                result[f"{key}_cpu_ms"] = round(statistics.median(cpus[name]) * 1e3, 2)
            logger.info(
                "%d rows, %d threads: %s",
                rows,
                threads,
                ", ".join(f"{name} {result[f'{name}_rows{rows}_threads{threads}_ms']:.2f} ms" for name in names),
            )
    return result


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
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    result = run(args)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
