"""What ``tool_choice: auto`` costs the engine, and how often a started call comes out well formed, in one run.

Overhead: weather questions rendered with the shipped tool template (app/tool_calls/templates), each
request 32 tokens (``--max-tokens``) with ``ignore_eos`` at temperature 0.8 and a seed of its own, all
submitted at once; run plain, and with every other request under the ``hermes`` structural tag of two
tools. Rounds alternate the two (``--repeats``); ``overhead_ratio`` is the median tok/s with tags over
the median without (1.0: free).

Well-formed calls: the same questions in the ``pythonic`` format, with a ``logit_bias`` on ``[`` (the
one token that opens a pythonic call list) so that every answer starts a call, decoded with the
structural tag and without it (plain decoding, then the same parser). A call is well formed when the
answer parses into complete calls, each naming one of the tools with arguments valid against its
schema; ``well_formed_with_tag`` and ``well_formed_without_tag`` are the shares of answers whose calls
all are.

    python scripts/bench_tools.py --json        # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import jsonschema
from transformers import AutoTokenizer

from app.model_store import resolve_model
from app.settings import Settings
from app.tool_calls import FORMATS, ToolSpec, parse_reply
from app.tool_calls.templates import ChatTemplate
from engine import Engine, EngineConfig, GrammarConstraint, SamplingParams

logger = logging.getLogger("bench_tools")

TOOLS = [
    ToolSpec(
        "get_weather",
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    ),
    ToolSpec(
        "get_time",
        {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}}, "required": ["zone"]},
    ),
]
CITIES = ["Paris", "Rome", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Seoul", "Dakar", "Riga", "Hanoi"]
CALL_BIAS = 40.0  # on "[": every answer opens a pythonic call list
PYTHONIC_SYSTEM = "Call functions as [name(arg=value)]. Functions:\n"


def chat_prompts(tokenizer, num_requests: int, pythonic: bool) -> list[list[int]]:
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in TOOLS]
    template = ChatTemplate.shipped()
    prompts = []
    for index in range(num_requests):
        question = {"role": "user", "content": f"What is the weather in {CITIES[index % len(CITIES)]}?"}
        if pythonic:
            system = PYTHONIC_SYSTEM + "\n".join(json.dumps(tool) for tool in tools)
            messages = [{"role": "system", "content": system}, question]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = template.render([question], tools)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[str], float]:
    """Each request's text, and the output tok/s of the run."""
    start = time.perf_counter()
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    texts: dict[str, str] = {}
    num_tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                texts[output.request_id] = output.text
                num_tokens += len(output.token_ids)
    return [texts[i] for i in ids], num_tokens / (time.perf_counter() - start)


def overhead_rates(engine: Engine, prompts: list[list[int]], max_tokens: int, with_tags: bool) -> float:
    tag = GrammarConstraint.structural_tag(FORMATS["hermes"].structural_tag(TOOLS, parallel=True))
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0.8,
            seed=index,
            ignore_eos=True,
            constraint=tag if with_tags and index % 2 == 0 else None,
        )
        for index in range(len(prompts))
    ]
    return run(engine, prompts, params)[1]


def well_formed_share(engine: Engine, prompts: list[list[int]], bracket: int, with_tag: bool) -> float:
    tool_format = FORMATS["pythonic"]
    tag = GrammarConstraint.structural_tag(tool_format.structural_tag(TOOLS, parallel=False))
    params = [
        SamplingParams(
            max_tokens=64,
            temperature=0.8,
            seed=index,
            logit_bias=((bracket, CALL_BIAS),),
            constraint=tag if with_tag else None,
        )
        for index in range(len(prompts))
    ]
    texts, _ = run(engine, prompts, params)
    schemas = {tool.name: tool.parameters for tool in TOOLS}
    num_well_formed = 0
    for text in texts:
        parsed = parse_reply(tool_format, text)
        ok = parsed.complete and bool(parsed.calls)
        for call in parsed.calls if ok else []:
            try:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            except (KeyError, ValueError, jsonschema.ValidationError):
                ok = False
        num_well_formed += ok
        logger.info("%s %s", "ok " if ok else "BAD", text.replace("\n", "\\n")[:100])
    return num_well_formed / len(texts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the data folder's default model)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-calls", type=int, default=24, help="answers per well-formed share")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each configuration, alternated")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    folder = args.model or str(resolve_model(settings.model, settings.home))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = Engine(EngineConfig(model=folder, max_num_seqs=64, max_num_batched_tokens=1024))
    prompts = chat_prompts(tokenizer, args.num_requests, pythonic=False)
    overhead_rates(engine, prompts[:4], 4, with_tags=True)  # warm-up: the first compile, oneDNN's first calls
    rates: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.repeats):
        for with_tags in (False, True) if round_ % 2 == 0 else (True, False):
            rates[with_tags].append(overhead_rates(engine, prompts, args.max_tokens, with_tags))
            logger.info("round %d, %s: %.1f tok/s", round_ + 1, "tags" if with_tags else "plain", rates[with_tags][-1])
    bracket = tokenizer.convert_tokens_to_ids("[")
    call_prompts = chat_prompts(tokenizer, args.num_calls, pythonic=True)
    with_tag = well_formed_share(engine, call_prompts, bracket, with_tag=True)
    without_tag = well_formed_share(engine, call_prompts, bracket, with_tag=False)
    plain, tagged = statistics.median(rates[False]), statistics.median(rates[True])
    result = {
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "plain_tok_s": round(plain, 1),
        "with_tags_tok_s": round(tagged, 1),
        "overhead_ratio": round(tagged / plain, 3),
        "num_calls": args.num_calls,
        "well_formed_with_tag": round(with_tag, 3),
        "well_formed_without_tag": round(without_tag, 3),
    }
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for key, value in result.items():
            sys.stdout.write(f"{key}: {value}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
