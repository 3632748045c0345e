"""How often JSON mode answers hold the fields a prompt asks for, against a running server.

Each prompt asks for an object with named fields ("Describe a ship as JSON with the fields name, length
and crew."). An answer counts when it parses as a JSON object holding every asked field. Two clients:

- ``openai``: ``response_format: {"type": "json_object"}`` through the official client;
  the same subjects asked with no fields ("Describe a ship as JSON.") give ``nonempty_share``, the share
  of answers that are an object holding anything (not ``{}``);
- ``instructor``: instructor's JSON mode (``instructor.Mode.JSON``) asking for a Pydantic model of those
  fields, its retries off (one attempt per prompt, so the share is per request). instructor pins older
  ``openai`` and ``rich`` releases than the project's, so it is not a project dependency: run this script
  with a Python that has it (``python -m venv v && v/bin/pip install instructor``).

    python -m scripts.benchmarks.gateway.bench_json_fields --url http://127.0.0.1:8000 --key sk-... --model <name>
    python -m scripts.benchmarks.gateway.bench_json_fields ... --client instructor --json  # last line: one JSON object

Only the official ``openai`` client (and instructor) is imported, so any Python with them runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

logger = logging.getLogger("bench_json_fields")

SUBJECTS = [
    ("a ship", ["name", "length", "crew"]),
    ("a book", ["title", "author", "year"]),
    ("a city", ["name", "country", "population"]),
    ("a planet", ["name", "moons", "diameter"]),
    ("a dog", ["name", "breed", "age"]),
    ("a car", ["make", "model", "year"]),
    ("a recipe", ["name", "ingredients", "minutes"]),
    ("a person", ["name", "age", "job"]),
    ("a movie", ["title", "director", "year"]),
    ("a mountain", ["name", "height", "country"]),
    ("a song", ["title", "artist", "year"]),
    ("a company", ["name", "founded", "employees"]),
]
MAX_TOKENS = 256  # room for three fields with indentation, and for the extra ones a small model adds


def prompts() -> list[tuple[str, list[str]]]:
    return [
        (f"Describe {subject} as JSON with the fields {', '.join(fields)}.", fields) for subject, fields in SUBJECTS
    ]


def holds_fields(text: str | None, fields: list[str]) -> bool:
    try:
        value = json.loads(text or "")
    except ValueError:
        return False
    return isinstance(value, dict) and all(field in value for field in fields)


def run_openai(client, model: str, seed: int, num_prompts: int, max_tokens: int) -> list[tuple[bool, str]]:
    results = []
    for prompt, fields in prompts()[:num_prompts]:
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_object"},
            max_tokens=max_tokens,
            temperature=0.0,
            seed=seed,
        )
        text = response.choices[0].message.content
        results.append((holds_fields(text, fields), text or ""))
    return results


def run_bare(client, model: str, seed: int, num_prompts: int, max_tokens: int) -> list[tuple[bool, str]]:
    """The same subjects asked with no fields ("Describe a ship as JSON."): does the answer hold anything?"""
    results = []
    for subject, _ in SUBJECTS[:num_prompts]:
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Describe {subject} as JSON."}],
            response_format={"type": "json_object"},
            max_tokens=max_tokens,
            temperature=0.0,
            seed=seed,
        )
        text = response.choices[0].message.content or ""
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        results.append((isinstance(value, dict) and bool(value), text))
    return results


def run_instructor(client, model: str, seed: int, num_prompts: int, max_tokens: int) -> list[tuple[bool, str]]:
    import instructor
    from pydantic import create_model

    patched = instructor.from_openai(client, mode=instructor.Mode.JSON)
    results = []
    for prompt, fields in prompts()[:num_prompts]:
        answer_model = create_model("Answer", **{field: (str | int | float | list | None, ...) for field in fields})
        try:
            answer = patched.chat.completions.create(
                model=model,
                response_model=answer_model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0.0,
                seed=seed,
                max_retries=0,
            )
            results.append((True, answer.model_dump_json()))
        except Exception as error:  # instructor raises its validation and retry errors as several types
            results.append((False, f"{type(error).__name__}: {str(error)[:200]}"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the server's base URL")
    parser.add_argument("--key", required=True, help="an inference API key")
    parser.add_argument("--model", required=True)
    parser.add_argument("--client", choices=("openai", "instructor"), default="openai")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=len(SUBJECTS), help=f"at most {len(SUBJECTS)}")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from openai import OpenAI

    client = OpenAI(base_url=f"{args.url}/v1", api_key=args.key, max_retries=0)
    run = run_instructor if args.client == "instructor" else run_openai
    results = run(client, args.model, args.seed, args.num_prompts, args.max_tokens)
    for ok, text in results:
        logger.info("%s %s", "ok " if ok else "BAD", text.replace("\n", "\\n")[:160])
    share = sum(ok for ok, _ in results) / len(results)
    logger.info(
        "%s: %d of %d answers hold the asked fields (%.2f)",
        args.client,
        sum(ok for ok, _ in results),
        len(results),
        share,
    )
    summary = {"client": args.client, "num_prompts": len(results), "fields_share": share}
    if args.client == "openai":
        bare = run_bare(client, args.model, args.seed, args.num_prompts, args.max_tokens)
        for ok, text in bare:
            logger.info("%s %s", "ok " if ok else "BAD", text.replace("\n", "\\n")[:160])
        summary["nonempty_share"] = sum(ok for ok, _ in bare) / len(bare)
        logger.info(
            "openai, no fields asked: %d of %d answers are non-empty objects", sum(ok for ok, _ in bare), len(bare)
        )
    if args.json:
        sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
