"""Structured output in the engine: the mask against xgrammar's own, constraints that hold, and rows left alone."""

import json
import re
import time
from pathlib import Path

import pytest
import torch
import xgrammar
from transformers import AutoTokenizer

from engine import Engine, GrammarConstraint, GrammarError, RequestError, RequestOutput, SamplingParams
from engine.sampling.grammar import GrammarCompiler, GrammarState
from engine.sampling.grammar_mask import GrammarMask, allowed_tokens, apply_grammar_mask, num_bitmask_words
from tests.engine.conftest import check_invariants, make_engine
from tests.engine.lora_helpers import make_peft_adapter
from tests.engine.test_n_choices import TINY_PAGE_BYTES

PROMPTS = [[(13 * i + 7 * j) % 240 + 3 for j in range(20 + 9 * i)] for i in range(4)]
SCHEMA = {
    "type": "object",
    "properties": {"size": {"enum": ["small", "medium", "large"]}, "name": {"type": "string"}},  # not sorted
    "required": ["size", "name"],
}
CHOICES = ("alpha", "beta gamma", 'say "hi"\n', "ünïcode")
DIGITS = r"[0-9]{2,5}-[a-z]{1,4}"


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[tuple[str, int], RequestOutput]:
    for prompt, params in requests:
        engine.add_request(prompt, params)
    finals: dict[tuple[str, int], RequestOutput] = {}
    while engine.has_unfinished_requests():
        finals |= {(o.request_id, o.index): o for o in engine.step() if o.finished}
        check_invariants(engine)
    return finals


def _compiler(folder: Path) -> GrammarCompiler:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_the_mask_equals_xgrammars_reference_on_random_logits(tiny_llama: Path) -> None:
    compiler = _compiler(tiny_llama)
    vocab = compiler.vocab_size
    prefixes = ['{"size": "sm', '{"size": "large", "name": "', "", '{"size": "large", "name": "x"}']
    states = []
    for prefix in prefixes:
        state = GrammarState(compiler.compile(GrammarConstraint.json_schema(SCHEMA)))
        for token in AutoTokenizer.from_pretrained(tiny_llama).encode(prefix, add_special_tokens=False):
            state.accept(token)
        states.append(state)
    states.append(GrammarState(compiler.compile(GrammarConstraint.regex(DIGITS))))
    generator = torch.Generator().manual_seed(0)
    num_rows = 9
    rows = [0, 2, 3, 5, 8]  # constrained rows among unconstrained ones
    logits = torch.randn(num_rows, vocab, generator=generator) * 4  # [num_rows, vocab]
    bitmask = torch.empty(len(rows), num_bitmask_words(vocab), dtype=torch.int32)
    for i, state in enumerate(states):
        state.fill_mask(bitmask, i)
    ours = apply_grammar_mask(logits.clone(), GrammarMask(torch.tensor(rows), bitmask))

    full = torch.full((num_rows, num_bitmask_words(vocab)), -1, dtype=torch.int32)  # every token allowed
    full[rows] = bitmask
    reference = logits.clone()
    xgrammar.apply_token_bitmask_inplace(reference, full, vocab_size=vocab, indices=rows, backend="torch_native")
    assert torch.equal(ours, reference)
    unconstrained = [row for row in range(num_rows) if row not in rows]
    assert torch.equal(ours[unconstrained], logits[unconstrained])
    # Each row allows some tokens and forbids most: the mask is neither empty nor everything.
    counts = allowed_tokens(bitmask, vocab).sum(dim=1)
    assert (counts > 0).all() and (counts < vocab).all()


def test_compile_errors_say_why_and_the_cache_answers_in_under_a_millisecond(tiny_llama: Path) -> None:
    compiler = _compiler(tiny_llama)
    with pytest.raises(GrammarError, match=r"^the json_schema constraint cannot be compiled: Unsupported type"):
        compiler.compile(GrammarConstraint.json_schema({"type": "nope"}))
    with pytest.raises(GrammarError, match="parenthesis is not closed"):
        compiler.compile(GrammarConstraint.regex("a(b"))
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarConstraint.json_schema("{not json")
    with pytest.raises(GrammarError, match="non-empty string"):
        GrammarConstraint.choice(["yes", ""])
    assert isinstance(GrammarError("x"), RequestError)  # the app answers every RequestError with a 400
    with pytest.raises(RequestError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, constraint=GrammarConstraint.json_object())

    first = compiler.compile(GrammarConstraint.json_schema(SCHEMA))
    start = time.perf_counter()
    again = compiler.compile(GrammarConstraint.json_schema(json.dumps(SCHEMA, indent=2)))  # the same, sent as text
    assert time.perf_counter() - start < 1e-3
    assert again is first and compiler.num_compiled == 1


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="roomy"),
        pytest.param({"pool_bytes": 16 * TINY_PAGE_BYTES, "max_num_batched_tokens": 32, "max_num_seqs": 6}, id="tight"),
    ],
)
def test_constrained_rows_match_and_leave_the_unconstrained_rows_alone(tiny_llama: Path, overrides: dict) -> None:
    """Constrained and unconstrained rows in the same steps, with preemption in the tight pool.

    The random model's text is what xgrammar allows; the unconstrained rows (greedy, and seeded samples)
    get exactly the tokens they get alone; a constrained greedy row gets the same tokens with or without
    preemption (its grammar state follows its tokens, which a recompute keeps).
    """
    plain_greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain_seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True, presence_penalty=0.5)
    constrained = [
        SamplingParams(max_tokens=40, temperature=0.0, constraint=GrammarConstraint.choice(CHOICES)),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=2, constraint=GrammarConstraint.regex(DIGITS)),
        SamplingParams(max_tokens=48, temperature=0.0, constraint=GrammarConstraint.json_schema(SCHEMA), logprobs=2),
        SamplingParams(
            max_tokens=24, temperature=0.9, seed=11, frequency_penalty=1.0, constraint=GrammarConstraint.json_object()
        ),
    ]
    engine = make_engine(tiny_llama, **overrides)
    mixed = _run(
        engine, [(PROMPTS[0], plain_greedy), (PROMPTS[1], plain_seeded), *zip(PROMPTS, constrained, strict=True)]
    )
    alone = _run(make_engine(tiny_llama), [(PROMPTS[0], plain_greedy), (PROMPTS[1], plain_seeded)])
    assert mixed["req-0", 0].token_ids == alone["req-0", 0].token_ids
    assert mixed["req-1", 0].token_ids == alone["req-1", 0].token_ids

    choice, regex_0, regex_1, schema, any_object = (
        mixed["req-2", 0],
        mixed["req-3", 0],
        mixed["req-3", 1],
        mixed["req-4", 0],
        mixed["req-5", 0],
    )
    assert choice.finish_reason == "stop" and choice.text in CHOICES
    for output in (regex_0, regex_1):
        assert output.finish_reason == "stop" and re.fullmatch(DIGITS, output.text), output.text
    assert len(schema.logprobs) == len(schema.token_ids)
    # JSON whitespace is allowed (in bounded runs), so the order is read past it.
    assert re.match(r'\{\s*"size"\s*:\s*"', schema.text), f"the properties come in the schema's order: {schema.text!r}"
    for output in (schema, any_object):
        if output.finish_reason == "stop":
            json.loads(output.text)
        else:  # cut by max_tokens: what came is a prefix xgrammar allowed
            assert output.finish_reason == "length" and output.text.startswith("{")
    if "pool_bytes" in overrides:
        assert engine.stats().num_preemptions > 0
        roomy = _run(make_engine(tiny_llama), [(PROMPTS[0], constrained[0]), (PROMPTS[2], constrained[2])])
        assert roomy["req-0", 0].token_ids == choice.token_ids
        assert roomy["req-1", 0].token_ids == schema.token_ids


def test_a_grammar_ends_the_output_even_with_ignore_eos(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, constraint=GrammarConstraint.choice(["x"]))
    output = _run(make_engine(tiny_llama), [(PROMPTS[0], params)])["req-0", 0]
    assert output.text == "x" and output.finish_reason == "stop"


@pytest.mark.default_model
def test_an_enum_schema_yields_one_of_its_values_on_the_default_model(tmp_path: Path) -> None:
    from app.model_store import resolve_model
    from app.settings import Settings

    settings = Settings.from_env()
    folder = resolve_model(settings.model, settings.home)
    engine = make_engine(folder, pool_bytes=64 * 1024**2)
    engine.add_adapter("tuned", make_peft_adapter(folder, tmp_path / "tuned", seed=5))
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]}
    prompt = "<|im_start|>user\nWhat colour is the sky? Answer in JSON.<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(
        max_tokens=32, temperature=0.8, seed=1, n=3, logprobs=1, constraint=GrammarConstraint.json_schema(schema)
    )
    ids = [engine.add_request(prompt, params), engine.add_request(prompt, params, adapter="tuned")]
    finals: dict[tuple[str, int], RequestOutput] = {}
    while engine.has_unfinished_requests():
        finals |= {(o.request_id, o.index): o for o in engine.step() if o.finished}
    for request_id in ids:
        for index in range(3):
            output = finals[request_id, index]
            assert output.finish_reason == "stop"
            assert json.loads(output.text)["colour"] in {"red", "green", "blue"}
            assert set(json.loads(output.text)) == {"colour"}


def test_json_may_hold_whitespace_as_models_write_it_in_bounded_runs(tiny_llama: Path) -> None:
    """A model that writes ``{\\n  "name"`` must be able to; a run longer than MAX_JSON_WHITESPACE cannot loop."""
    from engine.sampling.grammar import MAX_JSON_WHITESPACE

    compiler = _compiler(tiny_llama)
    indented = '{\n  "size": "large",\n  "name": "x"\n}'
    too_long = "{" + " " * (MAX_JSON_WHITESPACE + 1) + '"size": "large", "name": "x"}'
    for constraint in (GrammarConstraint.json_object(), GrammarConstraint.json_schema(SCHEMA)):
        compiled = compiler.compile(constraint)
        assert xgrammar.GrammarMatcher(compiled).accept_string(indented)
        assert not xgrammar.GrammarMatcher(compiled).accept_string(too_long)
