"""What salting the prefix cache per tenant costs: hit rate and time to first token, salted and shared.

Workload (fixed seed, random token ids, greedy, one output token), on the real default model on CPU:
--tenants tenants (8) each send --rounds requests (4), round-robin, one at a time. Every prompt is the
same system prompt of --system-len tokens (512) followed by the tenant's own message of --user-len tokens
(64, new for every request): a fleet of tenants whose applications share one system prompt.

Two engines run the same requests alternately, request by request, so a change in this shared machine's
load moves both alike: one salted with the tenant (``cache_salt``, what the gateway does by default), one
unsalted (``LORAPLEX_SHARE_BASE_PREFIX_CACHE=1``). Figures per engine: the prefix-cache hit rate (prompt
tokens served from the cache over all prompt tokens), the prompt tokens computed, and the median time to
first token. The pool holds every tenant's copy of the system prompt, so the salted engine misses once
per tenant and the shared one once in all.

    python -m scripts.benchmarks.engine.bench_cache_salt --json   # last line: one JSON object
"""

import argparse
import json
import logging
import random
import statistics
import sys

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams

logger = logging.getLogger("bench_cache_salt")

TOKEN_ID_MARGIN = 100  # random prompt ids stay clear of the special tokens at both ends of the vocabulary
MODES = ("salted", "shared")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the data folder's default model)")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4, help="requests per tenant")
    parser.add_argument("--system-len", type=int, default=512, help="tokens of the system prompt all tenants share")
    parser.add_argument("--user-len", type=int, default=64, help="tokens of each request's own message")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    folder = args.model or str(resolve_model(settings.model, settings.home))
    engines = {mode: Engine(EngineConfig(model=folder)) for mode in MODES}
    vocab_size = engines["salted"].model_config.vocab_size
    rng = random.Random(args.seed)

    def tokens(num: int) -> list[int]:
        return [rng.randrange(TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN) for _ in range(num)]

    for engine in engines.values():  # warm up on a prompt no measured request starts with
        engine.generate([tokens(args.system_len)], SamplingParams(max_tokens=1, temperature=0.0))
    system = tokens(args.system_len)
    cached = dict.fromkeys(MODES, 0)
    prompt_tokens = dict.fromkeys(MODES, 0)
    ttft_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        for tenant in range(args.tenants):
            prompt = system + tokens(args.user_len)
            order = MODES if (round_index + tenant) % 2 == 0 else MODES[::-1]
            for mode in order:
                salt = f"tenant-{tenant}" if mode == "salted" else None
                params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, cache_salt=salt)
                output = engines[mode].generate([prompt], params)[0]
                cached[mode] += output.num_cached_tokens
                prompt_tokens[mode] += len(prompt)
                ttft_s[mode].append(output.ttft_s)
    result = {
        "tenants": args.tenants,
        "rounds": args.rounds,
        "system_len": args.system_len,
        "user_len": args.user_len,
        **{
            mode: {
                "hit_rate": round(cached[mode] / prompt_tokens[mode], 4),
                "prompt_tokens_computed": prompt_tokens[mode] - cached[mode],
                "median_ttft_ms": round(statistics.median(ttft_s[mode]) * 1000, 1),
            }
            for mode in MODES
        },
    }
    computed_ratio = result["salted"]["prompt_tokens_computed"] / result["shared"]["prompt_tokens_computed"]
    result["computed_ratio"] = round(computed_ratio, 3)
    for mode in MODES:
        figures = result[mode]
        sys.stdout.write(
            f"{mode:>7}: hit rate {figures['hit_rate']:.1%}, {figures['prompt_tokens_computed']} prompt tokens "
            f"computed, median TTFT {figures['median_ttft_ms']} ms\n"
        )
    sys.stdout.write(f"salted computes {computed_ratio:.2f}x the prompt tokens of shared\n")
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
