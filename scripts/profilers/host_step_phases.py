"""Where the host's decode step goes: bench_gpu's workload with a clock around each phase of a step.

By default the tiny model of ``bench_gpu --quick`` (its random weights and adapters, one CPU thread); with
``--cuda`` bench_gpu's model shape (``--shape``, llama-1b) in bf16 on the GPU. 256 requests of 16 prompt tokens over
16 adapters round robin (``--base``: none), greedy, ``ignore_eos`` (``--frequency-penalty``, ``--logprobs``: none); once
all 256 decode together (and have ``--after`` output tokens each), ``--steps`` steps are clocked. Each phase is a call
the step makes once (scheduling, building the step's tables, moving them to the device, the forward pass, building the
sampler's input, sampling, launching the next pass ahead, reading the tokens, accepting, applying the tokens);
the report is each phase's median over the steps, and
the step's. One clock read a call, no profiler. The garbage collector's passes during those steps are timed too
(``gc_full``: the count and total ms of full collections, ``gc_young`` of the others); the objects of the start are
frozen first, as a worker process does, unless ``--no-freeze``. On a GPU a phase's time is the host's: the forward
pass is the time to launch its kernels (``graph_forward`` on a step that replays a CUDA graph: its inputs copied and
the graph launched), and reading the sampled tokens waits for the device (the step's one synchronisation); with
the next pass launched ahead (the default on CUDA), that wait is what the host's work left of the device's.

    python -m scripts.profilers.host_step_phases --json           # last line: one JSON object
    python -m scripts.profilers.host_step_phases --cuda --json    # on a CUDA machine
"""

import argparse
import functools
import gc
import json
import logging
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

import engine.step.step_runner as step_runner_module
from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams
from engine.memory.host_memory import freeze_startup_heap
from engine.sampling.sampler import DrawnTokens
from scripts.benchmarks.engine.bench_gpu import (
    ADAPTER_RANK,
    NUM_ROWS,
    SHAPES,
    TARGETS,
    make_requests,
    write_random_model,
)
from scripts.benchmarks.engine.bench_lora import write_synthetic_adapter

logger = logging.getLogger("host_step_phases")

# (owner, attribute, phase): functions step_runner calls by name, and methods the step calls once each.
PHASES = (
    (step_runner_module, "build_step_batch", "build"),
    (step_runner_module, "move_to_device", "move"),  # an eager step's tensors, in one copy
    (step_runner_module, "build_sampling_batch", "sampling_batch"),
    (step_runner_module, "draw", "sample"),  # the tokens drawn, their copy to the host queued
    (step_runner_module.LaunchAhead, "launch", "launch_ahead"),  # the next pass queued (where launched ahead)
    (DrawnTokens, "read", "read_tokens"),  # waits for the draw: the step's one synchronisation
    (step_runner_module.LaunchAhead, "take", "take_ahead"),  # the pass's logits handed to the step
    (step_runner_module, "accept", "accept"),
    (step_runner_module.Scheduler, "schedule", "schedule"),
    (step_runner_module.LlamaModel, "forward", "forward"),
    (step_runner_module.DecodeGraphs, "forward", "graph_forward"),  # a CUDA graph's step: inputs copied, replayed
    (step_runner_module.StepRunner, "_update", "update"),
)


def clocked(function: Callable, phase: str, times: dict[str, list[float]]) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            times[phase].append(time.perf_counter() - start)

    return wrapper


def collection_clock(collections: dict[str, list[float]]) -> Callable[[str, dict], None]:
    """A ``gc.callbacks`` entry that records each collection's seconds under "full" (generation 2) or "young"."""
    started = [0.0]

    def clock(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections["full" if info["generation"] == 2 else "young"].append(time.perf_counter() - started[0])

    return clock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", action="store_true", help="no adapter")
    parser.add_argument("--cuda", action="store_true", help="bench_gpu's model shape in bf16 on the GPU")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: tiny, llama-1b with --cuda")
    parser.add_argument("--model-dir", type=Path, default=None, help="bench_gpu's: where its models and adapters are")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="bench_gpu's: the tokenizer's folder")
    parser.add_argument("--steps", type=int, default=60, help="full decode steps clocked")
    parser.add_argument(
        "--after", type=int, default=1, help="clock from the step after which every row has this many output tokens"
    )
    parser.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="every request's (the sampler then counts its tokens)"
    )
    parser.add_argument("--logprobs", type=int, default=None, help="every request's (top alternatives per token)")
    parser.add_argument("--no-freeze", action="store_true", help="leave the start's objects to the collector")
    parser.add_argument(
        "--launch-ahead", default="auto", choices=("auto", "on", "off"), help="EngineConfig.launch_ahead (auto: CUDA)"
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    settings = Settings.from_env()
    home = args.model_dir or settings.home / "bench_gpu"
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda needs a CUDA device")
    shape = args.shape or ("llama-1b" if args.cuda else "tiny")
    dtype = torch.bfloat16 if args.cuda else torch.float32
    tokenizer_folder = args.tokenizer_dir or resolve_model(settings.model, settings.home)
    folder = write_random_model(home / shape, shape, tokenizer_folder, dtype)
    engine = Engine(
        EngineConfig(
            model=str(folder),
            device="cuda" if args.cuda else "cpu",
            dtype="bfloat16" if args.cuda else "float32",
            max_num_seqs=NUM_ROWS,
            max_num_batched_tokens=max(2048, NUM_ROWS),
            num_speculative_tokens=0,
            num_threads=None if args.cuda else 1,
            launch_ahead={"auto": None, "on": True, "off": False}[args.launch_ahead],
        )
    )
    names = []
    if not args.base:
        for index in range(16):
            path = write_synthetic_adapter(
                home / f"{shape}-r{ADAPTER_RANK}-{index}", engine.model_config, ADAPTER_RANK, index, TARGETS
            )
            engine.add_adapter(f"a{index}", path)
            names.append(f"a{index}")
    if not args.no_freeze:
        freeze_startup_heap()
    params = SamplingParams(
        max_tokens=args.after + args.steps + 8,
        temperature=0.0,
        ignore_eos=True,
        frequency_penalty=args.frequency_penalty,
        logprobs=args.logprobs,
    )
    for index, prompt in enumerate(make_requests(NUM_ROWS, engine.model_config.vocab_size, 16, seed=0)):
        engine.add_request(prompt, params, adapter=names[index % len(names)] if names else None)
    scheduler = engine.scheduler
    running = scheduler.running
    while not (len(running) == NUM_ROWS and all(seq.num_output_tokens >= args.after for seq in running)):
        engine.step()

    times: dict[str, list[float]] = defaultdict(list)
    collections: dict[str, list[float]] = defaultdict(list)
    gc.callbacks.append(collection_clock(collections))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in PHASES]
    for (owner, name, phase), (_, _, function) in zip(PHASES, originals, strict=True):
        setattr(owner, name, clocked(function, phase, times))
    try:
        for _ in range(args.steps):  # no synchronisation around a step: a pass launched ahead overlaps the next
            start = time.perf_counter()
            engine.step()
            times["step"].append(time.perf_counter() - start)
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)
    while engine.has_unfinished_requests():
        engine.step()

    gc.callbacks.pop()
    result = {phase: round(statistics.median(values) * 1000, 3) for phase, values in times.items()}
    gc_counts = {
        f"gc_{kind}": [len(collections[kind]), round(sum(collections[kind]) * 1000, 1)] for kind in ("full", "young")
    }
    result = {
        "shape": shape,
        "device": "cuda" if args.cuda else "cpu",
        "adapters": len(names),
        "rows": NUM_ROWS,
        **dict(sorted(result.items(), key=lambda kv: -kv[1])),
        **gc_counts,
    }
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        sys.stdout.writelines(f"{key:>16}: {value}\n" for key, value in result.items())
    return 0


if __name__ == "__main__":
    sys.exit(main())
