"""Where the engine's time goes on bench_vllm_cpu.py's workload: torch.profiler's operators, grouped by kind.

Runs the workload of ``bench_vllm_cpu.py`` (64 requests, prompts of 64 to 128 random tokens, 64 output
tokens, greedy, ``ignore_eos``; the engine's default precision unless ``--dtype`` and ``--quantization`` say
otherwise) on the base model and with 16 rank-8 adapters on all linear
modules, after a warm-up, under ``torch.profiler`` (CPU activities), and prints each kind's share of the
operators' self time, its calls per step, and the share of the wall time no operator accounts for
(Python, the scheduler, the sampler's host work). ``ONEDNN_VERBOSE=1`` in the environment adds oneDNN's
own line per GEMM on stderr, for the kernels it picks.

    python -m scripts.profilers.profile_engine --json        # last line: one JSON object
    python -m scripts.profilers.profile_engine --dtype bfloat16 --quantization int8 --json
"""

import argparse
import json
import logging
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams
from engine.adapters.lora_config import PROJECTIONS
from engine.config import ModelConfig
from scripts.benchmarks.engine.bench_lora import write_synthetic_adapter
from scripts.benchmarks.peers.bench_vllm_cpu import RANK, make_workload

logger = logging.getLogger("profile_engine")

# Operator name fragments, first match wins: the kind an operator's time counts for.
KINDS = (
    ("lora (native sgmv)", ("sgmv",)),
    ("gemm (oneDNN / BLAS)", ("mkldnn", "addmm", "aten::mm", "aten::bmm", "matmul", "linear", "onednn")),
    ("attention", ("paged_attention", "scaled_dot_product", "softmax", "_flash", "baddbmm")),
    (
        "gather / scatter / copy",
        (
            "index_select",
            "index_copy",
            "index_put",
            "gather",
            "scatter",
            "copy_",
            "clone",
            "cat",
            "stack",
            "contiguous",
            "to_copy",
            "_to_copy",
        ),
    ),
    (
        "elementwise (norm, rope, act, residual)",
        (
            "rms_norm",
            "rope",
            "add",
            "mul",
            "rsqrt",
            "pow",
            "mean",
            "silu",
            "neg",
            "sub",
            "div",
            "sigmoid",
            "where",
            "masked_fill",
        ),
    ),
    ("sampling", ("argmax", "topk", "sort", "cumsum", "searchsorted", "log_softmax")),
    (
        "allocation / views",
        (
            "empty",
            "zeros",
            "view",
            "reshape",
            "slice",
            "select",
            "as_strided",
            "narrow",
            "unsqueeze",
            "squeeze",
            "permute",
            "transpose",
            "expand",
            "split",
            "chunk",
            "unbind",
        ),
    ),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def profile_case(folder, workload: dict, num_adapters: int, args: argparse.Namespace) -> dict:
    config = EngineConfig(
        model=str(folder), max_num_seqs=64, kernels=args.kernels, dtype=args.dtype, quantization=args.quantization
    )
    engine = Engine(config)
    names = [f"a{i}" for i in range(num_adapters)]
    for name, path in zip(names, workload["adapters"], strict=False):
        engine.add_adapter(name, path)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(workload["prompts"][:2], warm, adapters=[names[0] if names else None, None])
    params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(workload["prompts"]):
        engine.add_request(prompt, params, adapter=names[index % len(names)] if names else None)
    num_steps = 0
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
            num_steps += 1
    wall_us = (time.perf_counter() - start) * 1e6
    by_kind: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    top = []
    for event in prof.key_averages():
        by_kind[kind_of(event.key)] += event.self_cpu_time_total
        calls[kind_of(event.key)] += event.count
        top.append((event.self_cpu_time_total, event.key, event.count))
    ops_us = sum(by_kind.values())
    top.sort(reverse=True)
    return {
        "precision": engine.stats().precision_reason,
        "steps": num_steps,
        "wall_s": round(wall_us / 1e6, 2),
        "tok_s": round(len(workload["prompts"]) * workload["max_tokens"] * 1e6 / wall_us, 1),
        "outside_operators_share": round(1 - ops_us / wall_us, 3),
        "kinds": {
            kind: {"share_of_ops": round(us / ops_us, 3), "calls_per_step": round(calls[kind] / num_steps, 1)}
            for kind, us in sorted(by_kind.items(), key=lambda item: -item[1])
        },
        "top_ops": [
            {"op": name, "share_of_ops": round(us / ops_us, 3), "calls_per_step": round(count / num_steps, 1)}
            for us, name, count in top[:15]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kernels", default="auto", help="the engine's kernels setting: auto, native or torch")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--quantization", default=None, choices=("int8",))
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    settings = Settings.from_env()
    folder = resolve_model(settings.model, settings.home)
    model = ModelConfig.from_folder(folder)
    root = settings.home / "bench" / f"adapters-r{RANK}-all-linear"
    adapters = [write_synthetic_adapter(root / f"a{i}", model, RANK, seed=i, targets=PROJECTIONS) for i in range(16)]
    workload = make_workload(model.vocab_size, args.num_requests, args.max_tokens, adapters, seed=0)
    result = {"threads": torch.get_num_threads(), "kernels": args.kernels}
    for case, k in (("base", 0), ("k16", 16)):
        result[case] = profile_case(folder, workload, k, args)
        logger.info("%s: %s", case, json.dumps(result[case]["kinds"]))
    out = sys.stdout
    if args.json:
        out.write(json.dumps(result) + "\n")
    else:
        out.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
