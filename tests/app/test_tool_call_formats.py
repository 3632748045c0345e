"""Tool-call formats without a model: each structural tag takes its format's calls, and the parsers read them back."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import xgrammar

from app.settings_defaults import TOOL_CALL_FORMATS
from app.tool_calls import (
    DEFAULT_FORMAT,
    FORMATS,
    CallArguments,
    CallStarted,
    StreamingParser,
    TextPart,
    ToolSpec,
    parse_reply,
)
from app.tool_calls.pythonic_grammar import arguments_grammar
from app.tool_calls.style import base_chat_style
from app.tool_calls.templates import ChatTemplate, ChatTemplateError, check_template
from tests.app.test_tool_calls_auto import PYTHONIC_TEMPLATE

WEATHER = ToolSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"],
    },
)
NOW = ToolSpec("now", {"type": "object", "properties": {}})
# Two calls in each format, after some text where the format allows text before its calls.
TWO_CALLS = {
    "hermes": 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris\\"", "unit": "C"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    "llama3_json": 'Checking.{"name": "get_weather", "parameters": {"city": "Pa}ris\\"", "unit": "C"}}'
    '{"name": "now", "parameters": {}}',
    "mistral": 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa}ris\\"", "unit": "C"}}, '
    '{"name": "now", "arguments": {}}]',
    "pythonic": 'Checking.[get_weather(city="Pa}ris\\"", unit="C"), now()]',
}
EXPECTED_CALLS = [("get_weather", {"city": 'Pa}ris"', "unit": "C"}), ("now", {})]


VOCAB = [chr(code) for code in range(32, 127)] + ["\n", "<eos>"]  # one token per character: any text fits
EOS = len(VOCAB) - 1


def test_the_setting_offers_exactly_the_registered_formats() -> None:
    assert sorted(TOOL_CALL_FORMATS) == sorted(FORMATS), "app/settings_defaults.py must name every registered format"
    assert TOOL_CALL_FORMATS[0] == DEFAULT_FORMAT and DEFAULT_FORMAT in FORMATS


@pytest.fixture(scope="module")
def compiler() -> xgrammar.GrammarCompiler:
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _accepts(compiler: xgrammar.GrammarCompiler, tag: str, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiler.compile_structural_tag(tag))
    return matcher.accept_string(text) and matcher.accept_token(EOS)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_constrains_and_reads_its_calls(compiler, name: str) -> None:
    tool_format = FORMATS[name]
    text = TWO_CALLS[name]
    assert _accepts(compiler, tool_format.structural_tag_text([WEATHER, NOW], parallel=True), text)
    assert not _accepts(compiler, tool_format.structural_tag_text([WEATHER, NOW], parallel=False), text)
    parsed = parse_reply(tool_format, text)
    assert parsed.complete
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == EXPECTED_CALLS
    assert parsed.content == "Checking."
    # A name outside the tools, or arguments outside the schema, cannot be written once a call opened.
    wrong_name = text.replace("get_weather", "get_wether")
    wrong_unit = text.replace('"C"', '"K"')
    for wrong in (wrong_name, wrong_unit):
        assert not _accepts(compiler, tool_format.structural_tag_text([WEATHER, NOW], parallel=True), wrong)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_streamed_a_character_at_a_time_the_calls_come_out_whole(name: str) -> None:
    parser = StreamingParser(FORMATS[name])
    events = [event for char in TWO_CALLS[name] for event in parser.feed(char)] + parser.finish()
    text = "".join(event.text for event in events if isinstance(event, TextPart))
    started = [(event.index, event.name) for event in events if isinstance(event, CallStarted)]
    arguments: dict[int, str] = {}
    for event in events:
        if isinstance(event, CallArguments):
            arguments[event.index] = arguments.get(event.index, "") + event.fragment
    assert text.strip() == "Checking."
    assert started == [(0, "get_weather"), (1, "now")]
    assert [json.loads(arguments[i]) for i in (0, 1)] == [args for _, args in EXPECTED_CALLS]
    if FORMATS[name].arguments_style == "json":  # JSON arguments arrive in many fragments, as written
        assert sum(isinstance(e, CallArguments) and e.index == 0 for e in events) > 10


def test_text_that_only_looks_like_a_call_stays_text() -> None:
    parsed = parse_reply(FORMATS["hermes"], "a < b and <tool but no call <tool")
    assert parsed.complete and not parsed.calls and parsed.content == "a < b and <tool but no call <tool"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_call_cut_short_is_no_call(name: str) -> None:
    text = TWO_CALLS[name]
    cut = text[: text.index("now") + 2]
    parsed = parse_reply(FORMATS[name], cut)
    assert not parsed.complete
    assert [call.name for call in parsed.calls] == ["get_weather"]


def test_unconstrained_text_that_breaks_the_format_is_not_a_call() -> None:
    parsed = parse_reply(FORMATS["hermes"], 'Sure <tool_call>{"name": 3}</tool_call>')
    assert not parsed.complete and not parsed.calls


def test_the_shipped_template_renders_tools_calls_and_results_in_the_hermes_format() -> None:
    template = check_template(ChatTemplate.shipped().source)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]
    text = template.render(messages, tools)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text and '"name": "get_weather"' in text.split("<tools>")[1]
    assert text.endswith("<|im_start|>assistant\n")
    # The call it renders is one the hermes parser reads.
    rendered_call = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_reply(FORMATS["hermes"], rendered_call).calls[0].name == "get_weather"


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("{{ messages.__class__.__mro__ }}", "sandbox forbids"),
        ("{{ messages.append(1) }}", "sandbox forbids"),
        ("{% for m in messages %}", "not valid Jinja"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "does not render the tools"),
        ("{{ raise_exception('no tools here') }}", "no tools here"),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}",
            "more than",
        ),
        ("x" * 70_000, "at most"),
    ],
)
def test_bad_templates_are_refused_saying_why(source: str, reason: str) -> None:
    with pytest.raises(ChatTemplateError, match=reason):
        check_template(source)


# Names a pythonic call must write and read back as they are: Python keywords, and names that are no identifier.
ODD_NAMES = ["from", "class", "None", "first-name", "1st", "a.b", "é", "with space", "x"]
VALUE_SCHEMAS = [
    ({"type": "integer"}, ["0", "7", "-12", "007", "-0", "1.5"]),
    ({"type": "number"}, ["0", "2.5", "-3", "01.5", "1."]),
    ({"type": "string"}, ['"Paris"', '""', '"a\\"b"', '"x\\ny"', "'single'"]),
    ({"type": "string", "maxLength": 3}, ['"abc"', '"abcd"']),
    ({"type": "boolean"}, ["True", "False", "true"]),
    ({"type": "null"}, ["None", "null"]),
    ({"enum": ["C", 1, None]}, ['"C"', "1", "None", '"F"']),
    ({"type": "array"}, ["[]", '[1, "a", [True]]', "[1,2]", "[007]"]),
    ({}, ['{"k": [1, None]}', "{}", "{1: 2}"]),
]


def _random_schema(rng: random.Random) -> dict[str, Any]:
    names = rng.sample(ODD_NAMES, rng.randint(0, 4))
    properties = {name: rng.choice(VALUE_SCHEMAS)[0] for name in names}
    required = [name for name in names if rng.random() < 0.5]
    return {"type": "object", "properties": properties, "required": required}


def _candidates(rng: random.Random, schema: dict[str, Any]) -> list[str]:
    """Argument texts to offer the grammar: well-formed ones, and ones with a repeated, reordered or ill-spelled
    argument or value."""
    values = {json.dumps(s, sort_keys=True): texts for s, texts in VALUE_SCHEMAS}
    names = list(schema["properties"])
    texts = []
    for _ in range(30):
        chosen = [name for name in names if name in schema["required"] or rng.random() < 0.5]
        if rng.random() < 0.3 and names:
            chosen.append(rng.choice(names))  # repeated
        if rng.random() < 0.3:
            rng.shuffle(chosen)
        pairs = [
            f"{name}={rng.choice(values[json.dumps(schema['properties'][name], sort_keys=True)])}" for name in chosen
        ]
        texts.append(", ".join(pairs))
    return texts


def test_every_pythonic_call_the_grammar_takes_the_parser_reads_back(compiler) -> None:
    # Over generated schemas, whatever arguments the grammar lets a model write parse into an object of the
    # schema's keys: "a started call is always valid" holds for pythonic calls too.
    rng = random.Random(14)
    num_accepted = 0
    for _ in range(150):
        schema = _random_schema(rng)
        grammar = compiler.compile_grammar(arguments_grammar(schema))
        for text in _candidates(rng, schema):
            matcher = xgrammar.GrammarMatcher(grammar)
            if not (matcher.accept_string(text) and matcher.accept_token(EOS)):
                continue
            num_accepted += 1
            reply = parse_reply(FORMATS["pythonic"], f"[f({text})]")
            assert reply.complete and len(reply.calls) == 1, (schema, text)
            arguments = json.loads(reply.calls[0].arguments)
            assert set(schema["required"]) <= set(arguments) <= set(schema["properties"]), (schema, text, arguments)
    assert num_accepted > 500  # the check is not vacuous


def test_the_review_s_pythonic_calls_are_read_or_refused_alike() -> None:
    schema = {
        "type": "object",
        "properties": {"from": {"type": "string"}, "first-name": {"type": "string"}, "n": {"type": "integer"}},
        "required": [],
    }
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    grammar = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_grammar(
        arguments_grammar(schema)
    )
    for text, expected in (
        ('from="Paris"', {"from": "Paris"}),
        ('first-name="Ada"', {"first-name": "Ada"}),
        ("n=007", None),
        ("n=1, n=2", None),
    ):
        matcher = xgrammar.GrammarMatcher(grammar)
        accepted = matcher.accept_string(text) and matcher.accept_token(EOS)
        reply = parse_reply(FORMATS["pythonic"], f"[f({text})]")
        read = json.loads(reply.calls[0].arguments) if reply.calls else None
        assert (accepted, read) == (expected is not None, expected), text


def test_a_format_needs_a_template_that_writes_calls_in_it(tmp_path) -> None:
    # The shipped template teaches hermes' <tool_call>: any other format without a template of its own is refused
    # when the server starts, saying which; a template that writes the sample call in the format is taken.
    assert base_chat_style(None, "hermes").tool_format.name == "hermes"
    for name in sorted(set(FORMATS) - {"hermes"}):
        with pytest.raises(ChatTemplateError, match=f"does not write calls in the {name} tool-call format"):
            base_chat_style(None, name)
    pythonic = tmp_path / "pythonic.jinja"
    pythonic.write_text(PYTHONIC_TEMPLATE)
    assert base_chat_style(pythonic, "pythonic").tool_format.name == "pythonic"
    with pytest.raises(ChatTemplateError, match="hermes tool-call format"):
        base_chat_style(pythonic, "hermes")
