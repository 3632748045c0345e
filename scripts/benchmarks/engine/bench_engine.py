"""Throughput of the engine against transformers' generate on the same workload, in one run.

Workload: N requests (default 64) with prompts of 32 to 256 random tokens and outputs of 16 to 128
tokens, drawn from a fixed seed; greedy, ignore_eos. The engine gets every request at once and
schedules them itself (continuous batching, at most --max-batch running); transformers gets static
batches of --max-batch requests in arrival order, left-padded, each run to its longest output.
Both count only the tokens the workload asked for.

The same run measures this machine's fp32 matmul rate and from it the compute ceiling: the output
tokens per second the workload would reach if every FLOP it needs (prompt and decode projections,
attention, the LM head for each generated token) ran at that rate.

    python -m scripts.benchmarks.engine.bench_engine --json        # last line: one JSON object
    python -m scripts.benchmarks.engine.bench_engine --dtype bfloat16 --quantization int8 --skip-hf

``--modes`` measures float32, bfloat16 and int8 weights (bfloat16 model dtype) side by side instead: one
engine each, the workload run on each in turn for ``--rounds`` rounds (so a load that comes and goes
falls on every mode alike), each mode's median reported, then ``bf16_vs_fp32`` and ``int8_vs_fp32``; with
each mode's precision and its pool capacity (sequences of 1,024 tokens a GiB of pool holds).
``--bf16-gemm`` (default: ``LORAPLEX_BF16_GEMM``, else auto) picks the native GEMM of bf16 and int8 weights.
"""

import argparse
import json
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams
from engine.config import ModelConfig
from engine.memory.page_pool import page_bytes
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import native_ops
from loraplex_kernels.projection.linear import LinearWeight, linear
from scripts.common.percentiles import percentile

logger = logging.getLogger("bench_engine")

MATMUL_SHAPES = ((512, 576, 1536), (1024, 1024, 1024), (2048, 2048, 2048))  # (m, k, n) tried for the peak
MODES = {  # name: (dtype, quantization)
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("bfloat16", "int8"),
}
CAPACITY_TOKENS = 1024  # pool capacity is counted in sequences this long
MODES_POOL_MIB = 1280  # each mode's engine: room for the default workload (64 requests) without preemption


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        prompt_len = rng.randint(32, 256)
        prompts.append([rng.randrange(100, vocab_size - 100) for _ in range(prompt_len)])
        outputs.append(rng.randint(16, 128))
    return Workload(prompts, outputs)


def measure_matmul_flops(repeats: int = 5) -> float:
    """Best fp32 matmul rate (FLOP/s) over a few shapes and every GEMM path here (BLAS, packed oneDNN,
    the native panels where the library builds).

    The ceiling takes the best rate this process reaches, so it never flatters the engine.
    """
    backends = [KernelBackend.TORCH] + ([KernelBackend.NATIVE] if native_ops() is not None else [])
    best = 0.0
    for m, k, n in MATMUL_SHAPES:
        a, b = torch.randn(m, k), torch.randn(n, k)  # [m, k], [n, k]
        runs = [lambda: a @ b.T]  # noqa: B023 (called in this iteration)
        for backend in backends:
            packed = LinearWeight.prepare(b, backend=backend)
            runs.append(lambda packed=packed: linear(a, packed))  # noqa: B023
        for run in runs:
            run()
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                best = max(best, 2 * m * k * n / (time.perf_counter() - start))
    return best


def workload_flops(cfg: ModelConfig, workload: Workload) -> float:
    """FLOPs the workload needs at minimum: projections for every fed token, attention, LM head per output."""
    d = cfg.head_dim
    per_token_linear = (
        2
        * cfg.num_layers
        * cfg.hidden_size
        * ((cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d + 3 * cfg.intermediate_size)
    )
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size
    attention_per_key = 4 * cfg.num_layers * cfg.num_heads * d  # QK^T and PV for one (query, key) pair
    total = 0.0
    for prompt, num_out in zip(workload.prompts, workload.output_lens, strict=True):
        num_fed = len(prompt) + num_out - 1  # the last generated token is never fed back
        total += num_fed * per_token_linear + num_out * lm_head
        total += attention_per_key * num_fed * (num_fed + 1) / 2
    return total


def run_engine(engine: Engine, workload: Workload) -> tuple[float, list[float]]:
    """Wall seconds of the workload and each request's time to first token."""
    start = time.perf_counter()
    ids = [
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for prompt, n in zip(workload.prompts, workload.output_lens, strict=True)
    ]
    ttft: dict[str, float] = {}
    done = 0
    while done < len(ids):
        for output in engine.step():
            if output.request_id not in ttft:
                ttft[output.request_id] = output.ttft_s
            done += output.finished
    return time.perf_counter() - start, [ttft[i] for i in ids]


def run_hf(model, workload: Workload, max_batch: int, pad_id: int) -> float:
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), max_batch):
        prompts = workload.prompts[first : first + max_batch]
        max_new = max(workload.output_lens[first : first + max_batch])
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # [batch, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [batch, width]
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
            )
    return time.perf_counter() - start


def sequences_per_gib(engine: Engine) -> int:
    """Sequences of CAPACITY_TOKENS tokens a GiB of this engine's pool holds (K/V in its pool's dtype)."""
    cfg, block_size = engine.model_config, engine.pool.block_size
    pages = -(-CAPACITY_TOKENS // block_size)
    return 2**30 // (pages * page_bytes(cfg, block_size, engine.pool.storage.dtype))


def run_modes(folder: str, args: argparse.Namespace) -> dict:
    """Each mode's engine on the same workload, alternated for ``args.rounds`` rounds: medians and ratios."""
    engines = {
        name: Engine(
            EngineConfig(
                model=folder,
                dtype=dtype,
                quantization=quantization,
                pool_bytes=args.pool_mb * 2**20,
                max_num_seqs=args.max_batch,
                max_num_batched_tokens=args.max_batched_tokens,
                num_threads=args.threads,
                bf16_gemm=args.bf16_gemm,
            )
        )
        for name, (dtype, quantization) in MODES.items()
    }
    cfg = next(iter(engines.values())).model_config
    workload = make_workload(args.num_requests, cfg.vocab_size, args.seed)
    warmup = make_workload(4, cfg.vocab_size, args.seed + 1)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    cpu_rates: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():
        run_engine(engine, warmup)
    for round_index in range(args.rounds):
        for name, engine in engines.items():
            cpu_start = time.process_time()
            seconds, _ = run_engine(engine, workload)
            rates[name].append(workload.num_output_tokens / seconds)
            cpu_rates[name].append(workload.num_output_tokens / (time.process_time() - cpu_start))
            logger.info(
                "round %d %s: %.1f tok/s, %.1f tok per CPU second",
                round_index,
                name,
                rates[name][-1],
                cpu_rates[name][-1],
            )
    result: dict = {
        "num_requests": args.num_requests,
        "max_batch": args.max_batch,
        "rounds": args.rounds,
        "num_output_tokens": workload.num_output_tokens,
    }
    for name, engine in engines.items():
        result[f"{name}_tok_s"] = round(statistics.median(rates[name]), 1)
        result[f"{name}_tok_s_rounds"] = [round(rate, 1) for rate in rates[name]]
        result[f"{name}_tok_per_cpu_s"] = round(statistics.median(cpu_rates[name]), 1)
        result[f"{name}_precision"] = engine.precision.reason
        result[f"{name}_bf16_gemm"] = engine.precision.bf16_gemm or ""
        result[f"{name}_weight_mib"] = round(sum(w.weight_bytes for w in engine_weights(engine)) / 2**20, 1)
        result[f"{name}_seqs_1k_per_gib"] = sequences_per_gib(engine)
    for name in ("bf16", "int8"):
        result[f"{name}_vs_fp32_cpu_time"] = round(result[f"{name}_tok_per_cpu_s"] / result["fp32_tok_per_cpu_s"], 3)
    result["bf16_vs_fp32"] = round(result["bf16_tok_s"] / result["fp32_tok_s"], 3)
    result["int8_vs_fp32"] = round(result["int8_tok_s"] / result["fp32_tok_s"], 3)
    return result


def engine_weights(engine: Engine) -> list[LinearWeight]:
    """Every projection of the engine's model, the LM head included."""
    weights = engine.model.weights
    layers = [w for layer in weights.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return [*layers, weights.lm_head]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the data folder's default model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=64, help="most sequences at once, for both sides")
    parser.add_argument("--max-batched-tokens", type=int, default=1024, help="the engine's token budget per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="measure the engine only")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--quantization", default=None, choices=("int8",))
    parser.add_argument("--modes", action="store_true", help="fp32, bf16 and int8 side by side (no transformers)")
    parser.add_argument("--rounds", type=int, default=3, help="with --modes: alternated rounds, medians reported")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--pool-mb", type=int, default=MODES_POOL_MIB, help="with --modes: each engine's pool, MiB")
    parser.add_argument(
        "--bf16-gemm",
        default=None,
        choices=("auto", "widen", "dot"),
        help="the native GEMM of bf16 and int8 weights (default: LORAPLEX_BF16_GEMM, else auto)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    args.bf16_gemm = args.bf16_gemm or settings.bf16_gemm
    folder = args.model or str(resolve_model(settings.model, settings.home))
    if args.modes:
        write_result(run_modes(folder, args), args.json)
        return 0
    engine = Engine(
        EngineConfig(
            model=folder,
            max_num_seqs=args.max_batch,
            dtype=args.dtype,
            quantization=args.quantization,
            max_num_batched_tokens=args.max_batched_tokens,
            num_threads=args.threads,
            bf16_gemm=args.bf16_gemm,
        )
    )
    cfg = engine.model_config
    workload = make_workload(args.num_requests, cfg.vocab_size, args.seed)
    warmup = make_workload(4, cfg.vocab_size, args.seed + 1)

    peak = measure_matmul_flops()
    flops = workload_flops(cfg, workload)
    ceiling = workload.num_output_tokens / (flops / peak)
    logger.info(
        "fp32 matmul peak %.1f GFLOP/s; workload %.1f TFLOP; ceiling %.1f tok/s", peak / 1e9, flops / 1e12, ceiling
    )

    run_engine(engine, warmup)
    engine_s, ttfts = run_engine(engine, workload)
    stats = engine.stats()
    engine_tok_s = workload.num_output_tokens / engine_s
    logger.info("engine: %.1f s, %.1f tok/s, %d preemptions", engine_s, engine_tok_s, stats.num_preemptions)
    result = {
        "num_requests": args.num_requests,
        "max_batch": args.max_batch,
        "num_output_tokens": workload.num_output_tokens,
        "num_prompt_tokens": sum(len(p) for p in workload.prompts),
        "matmul_gflops": round(peak / 1e9, 1),
        "workload_tflop": round(flops / 1e12, 3),
        "ceiling_tok_s": round(ceiling, 1),
        "engine_s": round(engine_s, 2),
        "engine_tok_s": round(engine_tok_s, 1),
        "fraction_of_ceiling": round(engine_tok_s / ceiling, 3),
        "engine_ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1),
        "engine_preemptions": stats.num_preemptions,
        "precision": engine.precision.reason,
        "seqs_1k_per_gib": sequences_per_gib(engine),
    }
    del engine
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        pad_id = model.config.pad_token_id or 0
        run_hf(model, warmup, args.max_batch, pad_id)
        hf_s = run_hf(model, workload, args.max_batch, pad_id)
        result["hf_s"] = round(hf_s, 2)
        result["hf_tok_s"] = round(workload.num_output_tokens / hf_s, 1)
        result["speedup"] = round(engine_tok_s / result["hf_tok_s"], 2)
        logger.info("transformers: %.1f s, %.1f tok/s", hf_s, result["hf_tok_s"])
    write_result(result, args.json)
    return 0


def write_result(result: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        sys.stdout.writelines(f"{key:>24}: {value}\n" for key, value in result.items())


if __name__ == "__main__":
    sys.exit(main())
