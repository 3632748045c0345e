"""Speculative decoding (n-gram prompt lookup) on against off, on an input-grounded workload with adapters.

The prompts ask for answers that copy spans of the prompt, the work fine-tuned adapters are called for:
a JSON record rewritten with one field changed, a passage quoted back word for word. Each request names
one of four synthetic LoRA adapters (random rank-8 weights on every projection) or the base model, so
one batch mixes adapters. Decoding is greedy, and the outputs with and without speculation must be the
same tokens (the script fails otherwise).

Two engines run in one process, one with ``num_speculative_tokens`` set and one without; each level of
concurrency (1, 8 and 64 requests at once) runs on both in turn, --rounds times, and each figure is its
median (the host is shared: a single run's ratio is noise). ``speedup_N`` is the off engine's median
wall time over the on engine's at N requests at once; ``acceptance_rate`` is accepted over proposed tokens.

    python -m scripts.benchmarks.engine.bench_speculative --json      # last line: one JSON object
"""

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams
from engine.config import ModelConfig
from scripts.benchmarks.engine.bench_lora import write_synthetic_adapter

logger = logging.getLogger("bench_speculative")

NUM_ADAPTERS = 4
ADAPTER_RANK = 8
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONCURRENCY = (1, 8, 64)
CITIES = ["Lisbon", "Oslo", "Nairobi", "Quito", "Hanoi", "Perth", "Dakar", "Tallinn", "Lima", "Kyoto"]
NAMES = ["Ada Moreau", "Bilal Haddad", "Chen Wei", "Dara Okafor", "Eva Lindqvist", "Farid Nasser", "Greta Holm"]
JOBS = ["pharmacist", "welder", "librarian", "pilot", "surveyor", "baker", "translator"]
PASSAGES = [
    "The river rises in the northern hills and runs south for three hundred kilometres before it reaches "
    "the sea. Along its banks the old towns kept their mills turning for centuries, grinding wheat and "
    "sawing timber, until the railway came and the mills fell silent one by one.",
    "A good bread needs only flour, water, salt and time. The dough is mixed, left to rest, folded every "
    "half hour and shaped before it proves overnight in a cool place. In the morning it is baked in a "
    "very hot oven until the crust is dark and sings as it cools.",
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion it "
    "agreed to fund the new library wing, to delay the repairs to the swimming pool, and to ask the "
    "council for a further grant for the youth centre.",
]


def make_prompt(rng: random.Random) -> str:
    if rng.random() < 0.5:
        record = {
            "name": rng.choice(NAMES),
            "age": rng.randint(21, 70),
            "job": rng.choice(JOBS),
            "city": rng.choice(CITIES),
            "email": f"user{rng.randint(100, 999)}@example.org",
            "phone": f"+1-555-{rng.randint(1000, 9999)}",
            "member_since": rng.randint(1995, 2024),
        }
        city = rng.choice([c for c in CITIES if c != record["city"]])
        return (
            f"Here is a customer record:\n{json.dumps(record, indent=2)}\n\nRewrite the record exactly as it is, "
            f'as JSON, but with "city" changed to "{city}". Output only the JSON.'
        )
    passage = rng.choice(PASSAGES)
    return f"Read this passage:\n\n{passage}\n\nQuote the passage back word for word, then say nothing else."


def build_engine(folder: Path, adapters: list[Path], num_speculative_tokens: int, bf16_gemm: str = "auto") -> Engine:
    config = EngineConfig(
        model=str(folder), max_num_seqs=64, num_speculative_tokens=num_speculative_tokens, bf16_gemm=bf16_gemm
    )
    engine = Engine(config)
    for index, path in enumerate(adapters):
        engine.add_adapter(f"a{index}", path)
    return engine


def run_level(
    engine: Engine, prompts: list[str], adapters: list[str | None], concurrency: int, max_tokens: int
) -> tuple[float, list[list[int]]]:
    """Serve every prompt with ``concurrency`` requests in flight at once; the wall time and each output's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    outputs: list[list[int]] = []
    for first in range(0, len(prompts), concurrency):
        batch = engine.generate(prompts[first : first + concurrency], params, adapters[first : first + concurrency])
        outputs += [out.token_ids for out in batch]
    return time.perf_counter() - start, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or name (default: the server's default model)")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens of the speculating engine")
    parser.add_argument("--rounds", type=int, default=3, help="on/off runs of each level, alternated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-1", type=int, default=4, help="requests served one at a time")
    parser.add_argument("--adapter-dir", type=Path, default=Path(tempfile.gettempdir()) / "loraplex-bench-spec")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY), help="levels to run")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = Settings.from_env()
    folder = resolve_model(args.model or settings.model, settings.home)
    model = ModelConfig.from_folder(folder)
    paths = [
        write_synthetic_adapter(args.adapter_dir / f"r{ADAPTER_RANK}-{i}", model, ADAPTER_RANK, i, ADAPTER_TARGETS)
        for i in range(NUM_ADAPTERS)
    ]
    on = build_engine(folder, paths, args.k)
    # The GEMM measured at load could come out the other way for a second engine on a busy host: the
    # engine without speculation runs the one the first chose, so only speculation differs between them.
    off = build_engine(folder, paths, 0, on.precision.bf16_gemm or "auto")
    tokenizer = on.tokenizer
    rng = random.Random(0)
    names = [f"a{i}" for i in range(NUM_ADAPTERS)] + [None]
    times: dict[tuple[int, str], list[float]] = {}
    levels = args.concurrency
    for concurrency in levels:
        num = args.requests_1 if concurrency == 1 else concurrency
        texts = [make_prompt(rng) for _ in range(num)]
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in texts
        ]
        adapters = [names[i % len(names)] for i in range(num)]
        for engine in (on, off):  # warm-up: the prompts' prefix blocks cached in both alike
            run_level(engine, prompts[:2], adapters[:2], 2, 4)
        for round_index in range(args.rounds):
            order = (("on", on), ("off", off)) if round_index % 2 == 0 else (("off", off), ("on", on))
            results = {}
            for label, engine in order:
                seconds, results[label] = run_level(engine, prompts, adapters, concurrency, args.max_tokens)
                times.setdefault((concurrency, label), []).append(seconds)
                logger.info("concurrency %d round %d %s: %.2f s", concurrency, round_index, label, seconds)
            if results["on"] != results["off"]:
                mismatched = sum(a != b for a, b in zip(results["on"], results["off"], strict=True))
                logger.error("%d outputs differ with speculation on", mismatched)
                return 1
    stats = on.speculator.stats
    report = {
        f"speedup_{c}": round(statistics.median(times[c, "off"]) / statistics.median(times[c, "on"]), 3) for c in levels
    }
    report |= {
        "acceptance_rate": round(stats.acceptance_rate, 3),
        "num_proposed_tokens": sum(stats.num_proposed.values()),
        "num_accepted_tokens": sum(stats.num_accepted.values()),
        "seconds": {f"{label}_{c}": [round(t, 2) for t in times[c, label]] for c in levels for label in ("on", "off")},
        "k": args.k,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
    }
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
