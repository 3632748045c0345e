"""What structured output costs the engine, and how long a grammar takes to compile, in one run.

Throughput: the usual mixed workload (64 requests, prompts of 64 to 128 random tokens, 64 output
tokens each, temperature 0.8 with a seed each, all submitted at once), run twice per round: plain, and
with every other request under a JSON schema. The schema asks for at least 16 records of three fields,
more than 64 tokens of JSON, so every constrained request also runs to its 64 tokens and both runs
produce the same number of tokens. Rounds alternate the two (--repeats, default 3); each figure is the
median over rounds; ``overhead_ratio`` is tok/s with schemas over tok/s without (1.0: free).

Compile time: the tokenizer's tables (built once, at the first compile), a schema never seen before,
and the same schema again (a cache hit; the median of 1000 lookups).

    python -m scripts.benchmarks.engine.bench_structured --json        # last line: one JSON object
"""

import argparse
import json
import logging
import random
import statistics
import sys
import time

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, GrammarConstraint, SamplingParams
from scripts.benchmarks.engine.bench_sampling import make_prompts, run_until_done

logger = logging.getLogger("bench_structured")

RECORDS_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 16,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "score": {"type": "integer"},
                    "label": {"enum": ["spam", "ham", "unknown"]},
                },
                "required": ["name", "score", "label"],
            },
        }
    },
    "required": ["records"],
}
NUM_CACHED_LOOKUPS = 1000


def throughput(engine: Engine, prompts: list[list[int]], max_tokens: int, with_schema: bool) -> float:
    """Output tok/s of one run; with a schema, every other request is constrained by RECORDS_SCHEMA."""
    constraint = GrammarConstraint.json_schema(RECORDS_SCHEMA)
    before = engine.stats().num_generated_tokens
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        constrained = with_schema and index % 2 == 0
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.8,
            seed=index,
            ignore_eos=True,
            constraint=constraint if constrained else None,
        )
        engine.add_request(prompt, params)
    run_until_done(engine)
    elapsed = time.perf_counter() - start
    num_tokens = engine.stats().num_generated_tokens - before
    if num_tokens != len(prompts) * max_tokens:
        raise RuntimeError(f"{num_tokens} tokens generated, not {len(prompts) * max_tokens}: a grammar ended early")
    return num_tokens / elapsed


def compile_times(engine: Engine) -> dict[str, float]:
    """Seconds to build the tokenizer's tables, milliseconds to compile a new schema and to find it again."""
    start = time.perf_counter()
    engine.grammars.compile(GrammarConstraint.json_object())  # the first compile builds the tokenizer's tables
    tables_s = time.perf_counter() - start
    schema = RECORDS_SCHEMA | {"title": f"bench-{time.time_ns()}"}  # never compiled before
    start = time.perf_counter()
    engine.grammars.compile(GrammarConstraint.json_schema(schema))
    first_ms = (time.perf_counter() - start) * 1e3
    lookups = []
    for _ in range(NUM_CACHED_LOOKUPS):
        start = time.perf_counter()
        engine.grammars.compile(GrammarConstraint.json_schema(schema))  # the schema as a request sends it again
        lookups.append((time.perf_counter() - start) * 1e3)
    return {"tables_s": tables_s, "first_ms": first_ms, "cached_ms": statistics.median(lookups)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the data folder's default model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each configuration, alternated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.num_requests < 1 or not 1 <= args.max_tokens <= 200:
        parser.error("--repeats and --num-requests must be at least 1, --max-tokens within [1, 200] (the schema's)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    folder = args.model or str(resolve_model(settings.model, settings.home))
    engine = Engine(
        EngineConfig(model=folder, max_num_seqs=64, max_num_batched_tokens=1024, enable_prefix_caching=False)
    )
    compiled = compile_times(engine)
    logger.info("tables %.2f s, first compile %.2f ms, cached %.4f ms", *compiled.values())
    prompts = make_prompts(args.num_requests, engine.model_config.vocab_size, random.Random(args.seed))
    throughput(engine, prompts[:4], 8, with_schema=True)  # warm-up: oneDNN's first calls, the mask's first build
    rates: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.repeats):
        for with_schema in (False, True) if round_ % 2 == 0 else (True, False):
            rate = throughput(engine, prompts, args.max_tokens, with_schema)
            rates[with_schema].append(rate)
            logger.info("round %d, %s: %.1f tok/s", round_ + 1, "half with a schema" if with_schema else "plain", rate)

    plain, constrained = statistics.median(rates[False]), statistics.median(rates[True])
    result = {
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "plain_tok_s": round(plain, 1),
        "with_schema_tok_s": round(constrained, 1),
        "plain_tok_s_rounds": [round(r, 1) for r in rates[False]],
        "with_schema_tok_s_rounds": [round(r, 1) for r in rates[True]],
        "overhead_ratio": round(constrained / plain, 3),
        "tokenizer_tables_s": round(compiled["tables_s"], 3),
        "compile_first_ms": round(compiled["first_ms"], 3),
        "compile_cached_ms": round(compiled["cached_ms"], 4),
    }
    out = sys.stdout
    if args.json:
        out.write(json.dumps(result) + "\n")
    else:
        out.writelines(f"{key:>26}: {value}\n" for key, value in result.items())
    return 0


if __name__ == "__main__":
    sys.exit(main())
