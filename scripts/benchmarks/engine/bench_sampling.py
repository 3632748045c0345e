"""What per-request sampling rules cost the engine, and what n choices save over n requests, in one run.

Part 1, overhead: 64 requests (prompts of 64 to 128 random tokens, 64 output tokens each, ignore_eos,
temperature 0.8 with a seed each), all submitted at once, run twice per round: plain, and with half of
the requests asking for presence, frequency and repetition penalties, a 20-entry logit_bias and top-5
logprobs. Rounds alternate the two (--repeats, default 3); each figure is the median over rounds.
``overhead_ratio`` is tok/s with the rules over tok/s without (1.0: free). Prefix caching is off here,
so later rounds do not reuse earlier rounds' prompts.

Part 2, n: one request with n = 4 on a 200-token prompt against four requests with that prompt submitted
together (prefix caching on, its best case), 32 output tokens each: prompt tokens computed, KV blocks
allocated, and wall time, each the median over rounds (a fresh prompt every round).

    python -m scripts.benchmarks.engine.bench_sampling --json        # last line: one JSON object
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
from engine import Engine, EngineConfig, SamplingParams

logger = logging.getLogger("bench_sampling")

NUM_BIASED_TOKENS = 20
NUM_TOP_LOGPROBS = 5
N_PROMPT_TOKENS = 200
N_CHOICES = 4
N_OUTPUT_TOKENS = 32


def make_prompts(num_requests: int, vocab_size: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(64, 128))] for _ in range(num_requests)]


def ruled_params(index: int, max_tokens: int, vocab_size: int, with_rules: bool) -> SamplingParams:
    """Every request samples at temperature 0.8 with its own seed; with rules, every other one asks for all of them."""
    plain = dict(max_tokens=max_tokens, temperature=0.8, seed=index, ignore_eos=True)
    if not with_rules or index % 2:
        return SamplingParams(**plain)
    rng = random.Random(index)
    bias = {rng.randrange(vocab_size): rng.uniform(-5, 5) for _ in range(NUM_BIASED_TOKENS)}
    return SamplingParams(
        **plain,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logit_bias=bias,
        logprobs=NUM_TOP_LOGPROBS,
    )


def run_until_done(engine: Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def throughput(engine: Engine, prompts: list[list[int]], max_tokens: int, with_rules: bool) -> float:
    vocab = engine.model_config.vocab_size
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, ruled_params(index, max_tokens, vocab, with_rules))
    run_until_done(engine)
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def n_versus_separate(engine: Engine, rng: random.Random) -> dict[str, dict[str, float]]:
    """One round: the same fresh prompt as n choices, then as n requests; what each computed and took."""
    prompt = [rng.randrange(100, engine.model_config.vocab_size - 100) for _ in range(N_PROMPT_TOKENS)]
    shapes = {
        "n": [SamplingParams(n=N_CHOICES, max_tokens=N_OUTPUT_TOKENS, temperature=0.8, seed=1, ignore_eos=True)],
        "separate": [
            SamplingParams(max_tokens=N_OUTPUT_TOKENS, temperature=0.8, seed=1 + i, ignore_eos=True)
            for i in range(N_CHOICES)
        ],
    }
    result = {}
    for name, params in shapes.items():
        prompt = [*prompt[1:], prompt[0]]  # a different prompt for each, so neither reuses the other's blocks
        before = engine.stats()
        start = time.perf_counter()
        for p in params:
            engine.add_request(prompt, p)
        run_until_done(engine)
        after = engine.stats()
        result[name] = {
            "prompt_tokens_computed": after.num_prefill_tokens - before.num_prefill_tokens,
            "kv_blocks_allocated": after.num_kv_blocks_allocated - before.num_kv_blocks_allocated,
            "wall_s": time.perf_counter() - start,
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the data folder's default model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each configuration, alternated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.num_requests < 1 or args.max_tokens < 1:
        parser.error("--repeats, --num-requests and --max-tokens must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    folder = args.model or str(resolve_model(settings.model, settings.home))
    rng = random.Random(args.seed)
    engine = Engine(
        EngineConfig(model=folder, max_num_seqs=64, max_num_batched_tokens=1024, enable_prefix_caching=False)
    )
    prompts = make_prompts(args.num_requests, engine.model_config.vocab_size, rng)
    throughput(engine, prompts[:4], 8, with_rules=True)  # warm-up: oneDNN's first calls, the rules' first build
    rates: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.repeats):
        for with_rules in (False, True) if round_ % 2 == 0 else (True, False):
            rate = throughput(engine, prompts, args.max_tokens, with_rules)
            rates[with_rules].append(rate)
            logger.info("round %d, %s: %.1f tok/s", round_ + 1, "with rules" if with_rules else "plain", rate)
    del engine

    engine = Engine(EngineConfig(model=folder, max_num_seqs=64, max_num_batched_tokens=512))
    rounds = [n_versus_separate(engine, rng) for _ in range(args.repeats)]

    def median(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rounds)

    plain, ruled = statistics.median(rates[False]), statistics.median(rates[True])
    result = {
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "plain_tok_s": round(plain, 1),
        "with_rules_tok_s": round(ruled, 1),
        "plain_tok_s_rounds": [round(r, 1) for r in rates[False]],
        "with_rules_tok_s_rounds": [round(r, 1) for r in rates[True]],
        "overhead_ratio": round(ruled / plain, 3),
        "n4_prompt_tokens_computed": median("n", "prompt_tokens_computed"),
        "separate4_prompt_tokens_computed": median("separate", "prompt_tokens_computed"),
        "n4_kv_blocks_allocated": median("n", "kv_blocks_allocated"),
        "separate4_kv_blocks_allocated": median("separate", "kv_blocks_allocated"),
        "n4_wall_s": round(median("n", "wall_s"), 3),
        "separate4_wall_s": round(median("separate", "wall_s"), 3),
    }
    out = sys.stdout
    if args.json:
        out.write(json.dumps(result) + "\n")
    else:
        out.writelines(f"{key:>34}: {value}\n" for key, value in result.items())
    return 0


if __name__ == "__main__":
    sys.exit(main())
