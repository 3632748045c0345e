"""A tenant's chat template cannot burn unbounded time or memory: each attack is refused within its 1 s budget.

Model-free: each case compiles and renders a template; the real-request case is in
tests/app/test_adapter_chat_templates.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from app.tool_calls.templates import (
    MAX_RENDER_SECONDS,
    SAMPLE_MESSAGES,
    SAMPLE_TOOLS,
    ChatTemplate,
    ChatTemplateError,
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
    started = time.thread_time()
    with pytest.raises(ChatTemplateError) as refused:
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
