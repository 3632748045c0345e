"""Fairness between tenants: tenant B's time to first token alone, and behind tenant A's flood, in one run.

Workload (fixed seed, random token ids, greedy, ignore_eos), on the real default model on CPU:

- A, "long": --num-a requests (200) with prompts of 180 to 220 tokens and max_tokens 48 to 96 (longer
  outputs only stretch the FIFO run: B waits there until 136 of A's requests are done).
- B, "short": bursts of --num-b requests (10) with prompts of 16 to 24 tokens and max_tokens 8.

Each figure is B's median time to first token (``RequestOutput.ttft_s``: from add_request to the first
generated token) over a burst, and the median over --bursts bursts where there are several:

1. B alone: a burst sent to an idle engine.
2. B under A's flood, policy "fair": all of A's requests are queued, and once A holds every running slot
   (max_num_seqs) and a step decodes for all of them, B's burst arrives; once it is done and A fills the
   batch again, the next one. Bursts alternate with those of (1), which run on a second, idle engine, so
   a change in this shared machine's load moves both figures alike.
3. B under A's flood, policy "fifo": the same arrival, one burst, which waits behind all of A's requests.

The script drives ``Engine.step()`` itself (no HTTP, no server), so B's requests arrive between two
steps: the figures leave out the wait for a step already in flight, at most one step (about 0.3 s with
64 sequences decoding on 2 cores). The FIFO run stops as soon as B has its first tokens.

    python -m scripts.benchmarks.engine.bench_fairness --json        # last line: one JSON object
"""

import argparse
import json
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams

logger = logging.getLogger("bench_fairness")

TENANT_A, TENANT_B = "a", "b"
TOKEN_ID_MARGIN = 100  # random prompt ids stay clear of the special tokens at both ends of the vocabulary


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Burst:
    """What one burst of B's requests saw."""

    ttft_s: float  # the median over the burst
    num_steps: int  # from its arrival to its last first token
    num_others_finished: int  # other requests that finished before its last first token


def make_requests(
    num: int, prompt_lens: tuple[int, int], max_tokens: tuple[int, int], vocab_size: int, rng: random.Random
) -> list[Request]:
    requests = []
    for _ in range(num):
        prompt_len = rng.randint(*prompt_lens)
        prompt = [rng.randrange(TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=rng.randint(*max_tokens), temperature=0.0, ignore_eos=True)
        requests.append(Request(prompt, params))
    return requests


def submit(engine: Engine, requests: list[Request], tenant: str) -> list[str]:
    return [engine.add_request(r.prompt, r.params, tenant=tenant) for r in requests]


def send_burst(engine: Engine, requests: list[Request]) -> Burst:
    """Send B's burst now and step until all of it is done (the engine serves whatever else it holds too)."""
    unfinished = set(submit(engine, requests, TENANT_B))
    ttft: dict[str, float] = {}
    num_steps = num_others_finished = 0
    while unfinished:
        outputs = engine.step()
        num_steps += len(ttft) < len(requests)
        for output in outputs:
            if output.request_id in unfinished:
                ttft.setdefault(output.request_id, output.ttft_s)
                if output.finished:
                    unfinished.remove(output.request_id)
            elif output.finished and len(ttft) < len(requests):
                num_others_finished += 1
    return Burst(statistics.median(ttft.values()), num_steps, num_others_finished)


def fill_batch(engine: Engine) -> int:
    """Step until one step decodes a token for every running slot; returns the requests finished meanwhile."""
    num_finished = 0
    while True:
        outputs = engine.step()
        num_finished += sum(output.finished for output in outputs)
        if len(outputs) == engine.config.max_num_seqs:
            return num_finished


def drain(engine: Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the data folder's default model)")
    parser.add_argument("--num-a", type=int, default=200, help="tenant A's queued long requests")
    parser.add_argument("--num-b", type=int, default=10, help="tenant B's short requests per burst")
    parser.add_argument("--a-prompt-len", type=int, nargs=2, default=(180, 220), metavar=("MIN", "MAX"))
    parser.add_argument("--a-max-tokens", type=int, nargs=2, default=(48, 96), metavar=("MIN", "MAX"))
    parser.add_argument("--b-prompt-len", type=int, nargs=2, default=(16, 24), metavar=("MIN", "MAX"))
    parser.add_argument("--b-max-tokens", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=3, help="B's bursts alone and under the fair flood")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the engine's running slots")
    parser.add_argument("--max-batched-tokens", type=int, default=512, help="the engine's token budget per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.num_a < args.max_num_seqs:
        parser.error("--num-a must be at least --max-num-seqs: A's flood fills every running slot")

    settings = Settings.from_env()
    folder = args.model or str(resolve_model(settings.model, settings.home))
    started = time.perf_counter()
    engines = {
        policy: Engine(
            EngineConfig(
                model=folder,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_batched_tokens,
                scheduling_policy=policy,
            )
        )
        for policy in ("fair", "fifo")
    }
    rng = random.Random(args.seed)
    vocab_size = engines["fair"].model_config.vocab_size
    a_requests = make_requests(args.num_a, args.a_prompt_len, args.a_max_tokens, vocab_size, rng)
    b_bursts = [
        make_requests(args.num_b, args.b_prompt_len, (args.b_max_tokens,) * 2, vocab_size, rng)
        for _ in range(args.bursts + 2)  # one more for the FIFO flood, and the last one warms both engines up
    ]
    for engine in engines.values():
        submit(engine, b_bursts[-1], "warmup")
        drain(engine)

    # B alone runs on the FIFO engine while it is idle (with one tenant, the policies are the same).
    fair, idle = engines["fair"], engines["fifo"]
    submit(fair, a_requests, TENANT_A)
    fill_batch(fair)
    preemptions_before = fair.stats().num_preemptions
    alone, flood = [], []
    for requests in b_bursts[: args.bursts]:
        alone.append(send_burst(idle, requests))
        flood.append(send_burst(fair, requests))
        logger.info(
            "B alone: %.0f ms; under A's flood with fairness: %.0f ms (%d step(s))",
            alone[-1].ttft_s * 1000,
            flood[-1].ttft_s * 1000,
            flood[-1].num_steps,
        )
        fill_batch(fair)
    fair_preemptions = fair.stats().num_preemptions - preemptions_before
    del fair, engines["fair"]  # its flood is abandoned; the FIFO run gets the machine to itself

    fifo = engines["fifo"]
    submit(fifo, a_requests, TENANT_A)
    num_a_finished = fill_batch(fifo)
    fifo_burst = send_burst(fifo, b_bursts[args.bursts])
    logger.info(
        "B under A's flood with FIFO: %.0f ms (%d steps, %d of A's requests done first)",
        fifo_burst.ttft_s * 1000,
        fifo_burst.num_steps,
        num_a_finished + fifo_burst.num_others_finished,
    )

    b_alone_s = statistics.median(burst.ttft_s for burst in alone)
    b_flood_s = statistics.median(burst.ttft_s for burst in flood)
    result = {
        "b_ttft_alone_ms": round(b_alone_s * 1000, 1),
        "b_ttft_flood_ms": round(b_flood_s * 1000, 1),
        "b_ttft_flood_fifo_ms": round(fifo_burst.ttft_s * 1000, 1),
        "ratio": round(b_flood_s / b_alone_s, 2),
        "ratio_fifo": round(fifo_burst.ttft_s / b_alone_s, 1),
        "b_ttft_alone_bursts_ms": [round(burst.ttft_s * 1000, 1) for burst in alone],
        "b_ttft_flood_bursts_ms": [round(burst.ttft_s * 1000, 1) for burst in flood],
        "flood_steps_fair": max(burst.num_steps for burst in flood),
        "flood_steps_fifo": fifo_burst.num_steps,
        "a_finished_before_b_fifo": num_a_finished + fifo_burst.num_others_finished,
        "fair_preemptions": fair_preemptions,
        "num_a": args.num_a,
        "num_b": args.num_b,
        "bursts": args.bursts,
        "a_prompt_len": list(args.a_prompt_len),
        "a_max_tokens": list(args.a_max_tokens),
        "b_prompt_len": list(args.b_prompt_len),
        "b_max_tokens": args.b_max_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_batched_tokens": args.max_batched_tokens,
        "total_s": round(time.perf_counter() - started, 1),
    }
    logger.info(
        "B's median TTFT: alone %.0f ms, under A's flood %.0f ms with fairness (%.2fx), %.0f ms with FIFO (%.0fx)",
        result["b_ttft_alone_ms"],
        result["b_ttft_flood_ms"],
        result["ratio"],
        result["b_ttft_flood_fifo_ms"],
        result["ratio_fifo"],
    )
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        sys.stdout.writelines(f"{key:>26}: {value}\n" for key, value in result.items())
    return 0


if __name__ == "__main__":
    sys.exit(main())
