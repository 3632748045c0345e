"""What ``tool_choice: auto`` costs the engine, and how often a started call comes out well formed, in one run.

Overhead: weather questions rendered with the shipped tool template (app/tool_calls/templates), each
request 32 tokens (``--max-tokens``) with ``ignore_eos`` at temperature 0.8 and a seed of its own, all
submitted at once; run plain, and with every other request under the ``hermes`` structural tag of two
tools. Rounds alternate the two (``--repeats``); ``overhead_ratio`` is the median tok/s with tags over
the median without (1.0: free).

Well-formed calls: the weather demo adapter (trained to answer weather questions with a hermes
``get_weather(city)`` call; trained once into the data folder if missing, or ``--weather-adapter``)
asked weather questions it never saw in training, rendered with its tool by the shipped template, at
``--call-temperature`` (1.5 by default) with a seed each, decoded with the ``hermes`` structural tag
(``tool_choice: auto``: text is free until a call opens) and without it (plain decoding, then the same
parser). A call is well formed when the answer parses into complete calls, each naming the tool with
arguments valid against its schema; ``well_formed_with_tag`` and ``well_formed_without_tag`` are the
shares of answers that started a call (wrote ``<tool_call>``) whose calls all are well formed, and
``calls_started_*`` the shares of answers that started one. At temperature 1.0 the demo adapter, trained
on exactly this call, writes it well formed with or without the tag; 1.5 is where a sampled call goes
wrong and the tag's guarantee shows.

    python -m scripts.benchmarks.engine.bench_tools --json        # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import jsonschema
from transformers import AutoTokenizer

from app.demo import weather
from app.demo.adapters import ensure_demo_adapters
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
WEATHER = "weather"
# Phrasings the weather adapter was not trained on (app/demo/weather.py), so its calls are not recited.
HELD_OUT_QUESTIONS = [
    "Could you look up the weather for {city}?",
    "I am flying to {city} tomorrow. What is it like there?",
    "weather {city} pls",
    "Should I pack a coat for {city}?",
    "What are the conditions in {city} right now?",
    "Is it a nice day in {city}?",
]


def chat_prompts(tokenizer, questions: list[str], tools: list[dict]) -> list[list[int]]:
    """Each question as one user turn, rendered with ``tools`` by the shipped template."""
    template = ChatTemplate.shipped()
    texts = [template.render([{"role": "user", "content": question}], tools) for question in questions]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def run(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams], adapter: str | None = None
) -> tuple[list[str], float]:
    """Each request's text, and the output tok/s of the run."""
    start = time.perf_counter()
    ids = [engine.add_request(prompt, p, adapter=adapter) for prompt, p in zip(prompts, params, strict=True)]
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


def well_formed_shares(
    engine: Engine, prompts: list[list[int]], temperature: float, with_tag: bool
) -> tuple[float, float]:
    """On the weather adapter: the share of answers that started a call, and of those, the share well formed."""
    tool_format = FORMATS["hermes"]
    tool = ToolSpec(weather.TOOL_NAME, weather.TOOL_PARAMETERS)
    tag = GrammarConstraint.structural_tag(tool_format.structural_tag([tool], parallel=True))
    params = [
        SamplingParams(max_tokens=64, temperature=temperature, seed=index, constraint=tag if with_tag else None)
        for index in range(len(prompts))
    ]
    texts = run(engine, prompts, params, adapter=WEATHER)[0]
    num_started = num_well_formed = 0
    for text in texts:
        if tool_format.trigger not in text:
            logger.info("text %s", text.replace("\n", "\\n")[:100])
            continue
        num_started += 1
        parsed = parse_reply(tool_format, text)
        ok = parsed.complete and bool(parsed.calls)
        for call in parsed.calls if ok else []:
            ok = ok and call.name == tool.name and _valid(call.arguments, tool.parameters)
        num_well_formed += ok
        logger.info("%s %s", "ok " if ok else "BAD", text.replace("\n", "\\n")[:100])
    return num_started / len(texts), num_well_formed / max(num_started, 1)


def _valid(arguments: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def weather_adapter(settings: Settings, folder: str, given: str | None) -> Path:
    if given is not None:
        return Path(given)
    trained = ensure_demo_adapters(settings, Path(folder))
    if WEATHER not in trained:
        raise SystemExit("bench_tools: the weather demo adapter could not be trained; pass --weather-adapter")
    return trained[WEATHER]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the data folder's default model)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-calls", type=int, default=48, help="answers per well-formed share")
    parser.add_argument("--call-temperature", type=float, default=1.5, help="of the well-formed answers")
    parser.add_argument("--weather-adapter", default=None, help="the weather demo adapter's folder (default: trained)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each configuration, alternated")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    folder = args.model or str(resolve_model(settings.model, settings.home))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = Engine(EngineConfig(model=folder, max_num_seqs=64, max_num_batched_tokens=1024))
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in TOOLS]
    questions = [f"What is the weather in {CITIES[i % len(CITIES)]}?" for i in range(args.num_requests)]
    prompts = chat_prompts(tokenizer, questions, tools)
    overhead_rates(engine, prompts[:4], 4, with_tags=True)  # warm-up: the first compile, oneDNN's first calls
    rates: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.repeats):
        for with_tags in (False, True) if round_ % 2 == 0 else (True, False):
            rates[with_tags].append(overhead_rates(engine, prompts, args.max_tokens, with_tags))
            logger.info("round %d, %s: %.1f tok/s", round_ + 1, "tags" if with_tags else "plain", rates[with_tags][-1])
    engine.add_adapter(WEATHER, weather_adapter(settings, folder, args.weather_adapter))
    asked = [
        HELD_OUT_QUESTIONS[i % len(HELD_OUT_QUESTIONS)].format(city=CITIES[i % len(CITIES)])
        for i in range(args.num_calls)
    ]
    call_prompts = chat_prompts(tokenizer, asked, [weather.CHAT_TOOL])
    started_with, with_tag = well_formed_shares(engine, call_prompts, args.call_temperature, with_tag=True)
    started_without, without_tag = well_formed_shares(engine, call_prompts, args.call_temperature, with_tag=False)
    plain, tagged = statistics.median(rates[False]), statistics.median(rates[True])
    result = {
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "plain_tok_s": round(plain, 1),
        "with_tags_tok_s": round(tagged, 1),
        "overhead_ratio": round(tagged / plain, 3),
        "num_calls": args.num_calls,
        "call_temperature": args.call_temperature,
        "well_formed_with_tag": round(with_tag, 3),
        "well_formed_without_tag": round(without_tag, 3),
        "calls_started_with_tag": round(started_with, 3),
        "calls_started_without_tag": round(started_without, 3),
    }
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for key, value in result.items():
            sys.stdout.write(f"{key}: {value}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
