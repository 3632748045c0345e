"""Throughput of the engine against transformers' generate on the same workload, in one run.

Workload: N requests (default 64) with prompts of 32 to 256 random tokens and outputs of 16 to 128
tokens, drawn from a fixed seed; greedy, ignore_eos. The engine gets every request at once and
schedules them itself (continuous batching, at most --max-batch running); transformers gets static
batches of --max-batch requests in arrival order, left-padded, each run to its longest output.
Both count only the tokens the workload asked for.

The same run measures this machine's fp32 matmul rate and from it the compute ceiling: the output
tokens per second the workload would reach if every FLOP it needs (prompt and decode projections,
attention, the LM head for each generated token) ran at that rate.

    python scripts/bench_engine.py --json        # last line: one JSON object
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
from kernels.backend import KernelBackend
from kernels.linear import LinearWeight, linear
from kernels.native_cpu import native_ops

logger = logging.getLogger("bench_engine")

MATMUL_SHAPES = ((512, 576, 1536), (1024, 1024, 1024), (2048, 2048, 2048))  # (m, k, n) tried for the peak


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the data folder's default model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=64, help="most sequences at once, for both sides")
    parser.add_argument("--max-batched-tokens", type=int, default=1024, help="the engine's token budget per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="measure the engine only")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    folder = args.model or str(resolve_model(settings.model, settings.home))
    engine = Engine(
        EngineConfig(model=folder, max_num_seqs=args.max_batch, max_num_batched_tokens=args.max_batched_tokens)
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
        "engine_ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
        "engine_preemptions": stats.num_preemptions,
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
    out = sys.stdout
    if args.json:
        out.write(json.dumps(result) + "\n")
    else:
        out.writelines(f"{key:>24}: {value}\n" for key, value in result.items())
    return 0


if __name__ == "__main__":
    sys.exit(main())
