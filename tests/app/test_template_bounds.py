"""A tenant's chat template cannot burn unbounded time or memory: each attack is refused within its 1 s budget.

Model-free: each case compiles and renders a template; the real-request case is in
tests/app/test_adapter_chat_templates.py.
"""

from __future__ import annotations

import gc
import inspect
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from app.tool_calls.templates import (
    MAX_RENDER_SECONDS,
    SAMPLE_MESSAGES,
    SAMPLE_TOOLS,
    ChatTemplate,
    ChatTemplateError,
    _environment,
    check_template,
)

MAX_REFUSAL_SECONDS = 1.5  # the 1 s budget, and room for a shared machine
SCHEMA_TOOLS_TEMPLATE = Path(__file__).parent / "data" / "schema_tools.jinja"

# Attacks only the clock stops: (case id, template source)
CLOCK_ATTACKS = [
    ("nested-loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
    (
        "macro-fan-out",
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    ),
]
# Attacks a size bound stops before they build anything large: (case id, template source, words the refusal must hold)
SIZE_ATTACKS = [
    ("string-repetition", "{{ 'x' * 10**10 }}", "`*` (repetition)"),
    ("list-repetition", "{{ ([1] * 10**9) | length }}", "`*` (repetition)"),
    (
        "doubling-by-tilde",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "`~`",
    ),
    (
        "doubling-by-plus",
        "{% set ns = namespace(s=['x']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "`+`",
    ),
    ("many-tildes", "{% set s = 'x' * 4000000 %}{{ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s }}", "`~`"),
    ("center-method", "{{ 'a'.center(10**9) }}", "`center`"),
    ("rjust-method", "{{ 'a'.rjust(10**9) }}", "`rjust`"),
    ("expandtabs-method", "{{ ('\t' * 1000).expandtabs(10**6) }}", "`expandtabs`"),
    ("replace-method", "{{ ('a' * 4000000).replace('a', 'bbbbbbbbbb') }}", "`replace`"),
    ("join-method", "{{ ('x' * 4000000).join(['a', 'b', 'c']) }}", "`join`"),
    ("format-width", "{{ '{:>1000000000}'.format(1) }}", "`format`"),
    ("format-nested-width", "{{ '{:>{}}'.format(1, 10**9) }}", "`format`"),
    ("format-reused-field", "{{ ('{0}' * 100000).format('x' * 1000) }}", "`format`"),
    ("printf-width", "{{ '%999999999d' % 1 }}", "`%` formatting"),
    ("printf-star-width", "{{ '%*d' % (10**9, 1) }}", "`%` formatting"),
    ("format-filter", "{{ '%999999999d' | format(1) }}", "`%` formatting"),
    ("center-filter", "{{ 'a' | center(1000000000) }}", "`center` filter"),
    ("indent-filter", "{{ ('a\n' * 1000000) | indent(100000) }}", "`indent` filter"),
    ("wordwrap-filter", "{{ ('a ' * 100000) | wordwrap(1, wrapstring='x' * 100000) }}", "`wordwrap` filter"),
    ("replace-filter", "{{ ('a' * 4000000) | replace('a', 'bbbbbbbbbb') }}", "`replace` filter"),
    ("batch-fill", "{{ [1] | batch(1000000000, 'x') | list | length }}", "`batch` filter"),
    ("sum-of-lists", "{{ (range(1000) | batch(1) | list) | sum(start=[]) }}", "adds numbers only"),
    ("tojson-indent", "{{ messages | tojson(indent=1000000000) }}", "tojson's indent"),
    ("huge-power", "{{ 10 ** (10 ** 8) }}", "`**`"),
    (
        "squaring-loop",
        "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "`*` would build an integer",
    ),
]


@contextmanager
def _only_the_renders_objects_collected() -> Iterator[None]:
    """The process's own objects kept out of the collector's sight while a render is timed: a full collection, which
    the objects a render builds can set off, walks every live object, and in a test run holding torch and the gateway
    that is more CPU time than the render's own. The objects the render builds are still collected, at its cost."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("source", [pytest.param(s, id=case) for case, s in CLOCK_ATTACKS])
def test_each_endless_render_is_stopped_by_the_clock(source: str) -> None:
    template = ChatTemplate(source)
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="ran longer than 1 s"):
        template.render(SAMPLE_MESSAGES, SAMPLE_TOOLS)
    assert time.monotonic() - started < MAX_REFUSAL_SECONDS


@pytest.mark.parametrize(("source", "words"), [pytest.param(s, w, id=case) for case, s, w in SIZE_ATTACKS])
def test_each_growing_value_is_refused_by_its_bound_saying_why(source: str, words: str) -> None:
    # Traced as a tenant's template is, with a clock that cannot fire first: the refusal must be the size
    # bound's. Its CPU time, not the wall clock, measures the work (a loaded machine stalls the wall clock).
    template = ChatTemplate(source, max_render_seconds=60.0)
    with _only_the_renders_objects_collected(), pytest.raises(ChatTemplateError) as refused:
        started = time.thread_time()
        template.render(SAMPLE_MESSAGES, SAMPLE_TOOLS)
    assert time.thread_time() - started < MAX_RENDER_SECONDS  # ~0.2 s at most here (doubling-by-plus)
    assert words in str(refused.value)


def test_an_attack_hidden_from_the_sample_is_refused_on_the_conversation_that_meets_it() -> None:
    hidden = (
        "{% if messages | length > 6 %}"
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        "{% endif %}"
    )
    template = check_template(ChatTemplate.shipped().source + hidden)  # the sample has 6 messages: it passes
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="ran longer than 1 s"):
        template.render([*SAMPLE_MESSAGES, {"role": "user", "content": "More."}], SAMPLE_TOOLS)
    assert time.monotonic() - started < MAX_REFUSAL_SECONDS


def test_real_templates_render_well_within_the_budget() -> None:
    shipped = ChatTemplate(ChatTemplate.shipped().source)  # as a tenant's would be: traced
    large = check_template(SCHEMA_TOOLS_TEMPLATE.read_text(encoding="utf-8"))
    tools = [
        {**SAMPLE_TOOLS[0], "function": {**SAMPLE_TOOLS[0]["function"], "name": f"get_weather_{i}"}} for i in range(8)
    ]
    messages = [SAMPLE_MESSAGES[0], *SAMPLE_MESSAGES[1:] * 5]
    for template in (shipped, large):
        started = time.monotonic()
        rendered = template.render(messages, tools)
        assert time.monotonic() - started < MAX_RENDER_SECONDS / 4  # ~25 ms traced, on a loaded machine
        assert "get_weather_7" in rendered and rendered.count("18 C, sunny") == 5
    assert "city?: string" not in large.render(messages, tools)  # the schema macro ran: required, so no "?"
    assert "city: string" in large.render(messages, tools)


# Every global, filter and test the sandbox offers, each given the largest values it lets a template build (a
# text of 4 MiB, a list of 500,000 numbers, a list of 400,000 short strings, a dict of 100,000 keys), passed in
# as the messages' contents so that building them costs the render nothing.
LARGEST_VALUES = {
    "T": "ab \n" * 1_000_000,
    "L": list(range(100_000)) * 5,
    "W": ["ab"] * 400_000,
    "D": dict.fromkeys(range(100_000), "v"),
}
LARGEST = "".join(f"{{% set {name} = messages[{i}].content %}}" for i, name in enumerate(LARGEST_VALUES))
LARGEST_MESSAGES = [{"role": "user", "content": value} for value in LARGEST_VALUES.values()]
# (name, hostile expressions over T, L, W and D)
FILTER_CASES = {
    "abs": ["L | map('abs') | list", "(-10) ** 19000 | abs"],
    "attr": ["L | map('attr', 'real') | list", "T | attr('upper')"],
    "batch": ["L | batch(3) | list", "L | batch(1000000000, 'x') | list"],
    "capitalize": ["T | capitalize", "W | map('capitalize') | list"],
    "center": ["T | center(1000000000)", "'a' | center(4000000)"],
    "count": ["L | count", "T | count"],
    "d": ["missing | d(T)", "T | d(L)"],
    "default": ["missing | default(T)", "L | default(T)"],
    "dictsort": ["D | dictsort", "D | dictsort(by='value', reverse=true)"],
    "first": ["L | first", "T | first"],
    "float": ["T | float", "L | map('float') | list"],
    "format": ["'%-4000000s' | format(1)", "('%s' * 10000) | format(*(range(10000) | list))"],
    "groupby": ["L | groupby('real') | list", "W | groupby(0) | list"],
    "indent": ["T | indent(1000)", "T | indent(T)"],
    "int": ["('9' * 4000000) | int", "W | map('int') | list"],
    "items": ["D | items | list", "D | items | map('first') | list"],
    "join": ["L | join(T)", "W | join(',')"],
    "last": ["L | last", "T | last"],
    "length": ["L | length", "T | length"],
    "list": ["T | list", "D | list"],
    "lower": ["T | lower", "W | map('lower') | list"],
    "map": ["W | map('upper') | list", "L | map('string') | list"],
    "max": ["L | max", "W | max"],
    "min": ["L | min", "W | min"],
    "random": ["L | random", "T | random"],
    "reject": ["L | reject('odd') | list", "W | reject('in', T) | list"],
    "rejectattr": ["W | rejectattr(0) | list", "L | rejectattr('real') | list"],
    "replace": ["T | replace('a', 'xxxx')", "T | replace('', 'x')"],
    "reverse": ["T | reverse", "L | reverse | list"],
    "round": ["1.5 | round(100000000, 'ceil')", "12345 | round(-100000000)"],
    "select": ["L | select('odd') | list", "W | select('in', T) | list"],
    "selectattr": ["W | selectattr(0) | list", "L | selectattr('real', 'gt', 5) | list"],
    "slice": ["L | slice(1000000000) | list", "L | slice(3) | list"],
    "sort": ["W | sort", "L | sort(reverse=true)"],
    "string": ["L | string", "W | string"],
    "sum": ["L | sum", "L | batch(1) | sum(start=[])"],
    "title": ["T | title", "W | map('title') | list"],
    "tojson": ["L | tojson", "[L, W] | tojson(indent=64)", "W | tojson(separators=(T, T))"],
    "trim": ["(' ' * 4000000) | trim", "T | trim('ab')"],
    "truncate": ["T | truncate(1000000000)", "T | truncate(5, end=T)"],
    "unique": ["L | unique | list", "W | unique | list"],
    "upper": ["T | upper", "W | map('upper') | list"],
    "wordcount": ["T | wordcount", "L | map('string') | map('wordcount') | list"],
    "wordwrap": ["T | wordwrap(1)", "T | wordwrap(1000000000)"],
}
GLOBAL_CASES = {
    "range": ["range(1000000000) | list", "range(100000) | list"],
    "dict": ["dict.fromkeys(L)", "dict(a=T, b=L)"],
    "namespace": ["namespace(a=T, b=L)", "namespace(D)"],
    "cycler": ["cycler(*L).next()", "cycler(T, L).current"],
    "joiner": ["joiner(T)() ~ joiner(T)()", "joiner(L)()"],
    "raise_exception": ["raise_exception(T)", "raise_exception(L)"],
    "strftime_now": ["strftime_now('%c' * 100)", "strftime_now(T)"],
}
MAX_RENDER_PEAK_BYTES = 128 * 2**20  # what one render may build in all takes ~100 MiB at most


def _outcome(template: ChatTemplate) -> str:
    try:
        template.render(LARGEST_MESSAGES, SAMPLE_TOOLS)
    except ChatTemplateError as error:
        return str(error)
    return "rendered"


def _assert_bounded(source: str) -> None:
    """One render of ``source``, a tenant's template, ends within its 1 s (rendered or refused), and its memory is
    bounded by what the sandbox lets it build, whatever the clock: traced allocations (which slow it) under a
    longer deadline stay below MAX_RENDER_PEAK_BYTES."""
    # The deadline is the wall clock's; the CPU time the render took measures the work done past it (a C call
    # the clock cannot interrupt), which a machine loaded by other processes does not stretch.
    template = ChatTemplate(source)
    with _only_the_renders_objects_collected():
        started = time.thread_time()
        outcome = _outcome(template)
        cpu_seconds = time.thread_time() - started
    assert cpu_seconds < MAX_REFUSAL_SECONDS, (source, outcome)
    assert len(outcome) < 1024, source  # a refusal quotes no value whole
    tracemalloc.start()
    try:
        outcome = _outcome(ChatTemplate(source, max_render_seconds=2.0))
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < MAX_RENDER_PEAK_BYTES, (source, peak_bytes, outcome)


def test_the_sandbox_offers_only_what_chat_templates_use() -> None:
    environment = _environment()
    assert set(environment.filters) == set(FILTER_CASES)
    assert set(environment.globals) == set(GLOBAL_CASES)
    assert not {"pprint", "urlize", "xmlattr", "lipsum", "safe", "escape"} & {
        *environment.filters,
        *environment.globals,
    }


@pytest.mark.parametrize(("name", "expressions"), [*FILTER_CASES.items(), *GLOBAL_CASES.items()])
def test_each_offered_filter_and_global_is_bounded_in_time_and_memory(name: str, expressions: list[str]) -> None:
    for expression in expressions:
        _assert_bounded(LARGEST + "{{ " + expression + " }}")


def _takes_an_argument(test: Callable[..., Any]) -> bool:
    """Whether a Jinja test takes an argument beside the value (``divisibleby(3)``, ``in(seq)``)."""
    parameters = list(inspect.signature(test).parameters.values())
    if getattr(test, "jinja_pass_arg", None) is not None:
        parameters = parameters[1:]  # the environment or context Jinja passes first
    return len(parameters) > 1


def test_each_offered_test_is_bounded_in_time_and_memory() -> None:
    environment = _environment()
    for name, test in sorted(environment.tests.items()):
        argument = ", L" if _takes_an_argument(test) else ""
        for value in ("T", "L", "W"):
            _assert_bounded(LARGEST + f"{{{{ [{value}, {value}] | select('{name}'{argument}) | list | length }}}}")


# The attacks the review measured (16 s, 23 s) and how an adapter hid them from the upload's sample.
HIDDEN_ATTACKS = [
    ("lipsum", "{{ lipsum(1, min=3000000, max=3000001) }}", "calls `lipsum`"),
    ("pprint", "{{ (range(100000) | list) * 40 | pprint }}", "the filter `pprint`"),
    ("urlize", "{{ messages | string | urlize }}", "the filter `urlize`"),
]


@pytest.mark.parametrize(("source", "words"), [pytest.param(s, w, id=case) for case, s, w in HIDDEN_ATTACKS])
def test_what_is_not_offered_is_refused_at_upload_however_it_hides(source: str, words: str) -> None:
    hidden = "{% if messages | length > 6 %}" + source + "{% endif %}"
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=words):
        check_template(ChatTemplate.shipped().source + hidden)
    assert time.monotonic() - started < MAX_REFUSAL_SECONDS


def test_values_kept_across_frames_are_bounded_by_what_the_render_builds_in_all() -> None:
    # Each value is under the bound, but a macro that calls itself keeps one per frame, and a list one per item.
    for source in (
        "{% macro f(n, s) %}{% if n > 0 %}{{ f(n - 1, s ~ 'x') }}{% endif %}{% endmacro %}{{ f(300, 'x' * 4000000) }}",
        "{% set l = range(100000) | list %}{% macro f(n, x) %}{% if n > 0 %}{{ f(n - 1, x[::-1]) }}{% endif %}"
        "{% endmacro %}{{ f(300, l) }}",
        "{{ range(100000) | map('string') | map('replace', '1', 'x' * 4000000) | list | length }}",
        "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}"
        "{% for i in range(64) %}{% set ns.s = d(ns.s) %}{% endfor %}",
    ):
        tracemalloc.start()
        try:
            with pytest.raises(ChatTemplateError, match=r"went past|would build"):
                ChatTemplate(source, max_render_seconds=60.0).render(SAMPLE_MESSAGES, SAMPLE_TOOLS)
            peak_bytes = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak_bytes < MAX_RENDER_PEAK_BYTES, (source, peak_bytes)
