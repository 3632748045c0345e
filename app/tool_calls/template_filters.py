"""The filters a chat template is offered: Jinja's own that chat templates use, bounded, and ``tojson``.

Jinja's filters that pad, fill or multiply have the sizes they would build bounded before they run; every
filter's result is charged to the render's budget and each call checks its clock
(app/tool_calls/render_deadline.py). Left out: ``pprint`` (its time grows with a value's structure, in
Python code far from the template), the filters that make HTML or URLs (``urlize``, ``urlencode``,
``xmlattr``, ``striptags``, ``e``/``escape``/``forceescape``, ``safe``), and ``filesizeformat``: no chat
template uses them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jinja2
from jinja2 import filters as jinja_filters
from jinja2.defaults import DEFAULT_FILTERS

from app.tool_calls.render_deadline import charge, check_clock
from app.tool_calls.template_sizes import (
    MAX_JSON_INDENT,
    TemplateBoundError,
    check_printf,
    is_int,
    refuse_past_bound,
    size_of,
)

MAX_ROUND_DIGITS = 100  # round's precision either way: ``ceil`` and a negative one build 10**precision
MAX_SLICES = 100_000  # as many lists as ``range`` may count
# Jinja's ``sort`` calls a Python key function on every item, in one C call the render's clock cannot stop;
# templates sort a handful of keys or tools.
MAX_SORT_ITEMS = 10_000
# Jinja's ``title`` splits its text into a Python list of words first, ~50 bytes a character; templates
# title-case a role's name.
MAX_TITLE_CHARS = 64 * 1024
_OFFERED_NAMES = [
    "abs",
    "attr",
    "batch",
    "capitalize",
    "center",
    "count",
    "d",
    "default",
    "dictsort",
    "first",
    "float",
    "format",
    "groupby",
    "indent",
    "int",
    "items",
    "join",
    "last",
    "length",
    "list",
    "lower",
    "map",
    "max",
    "min",
    "random",
    "reject",
    "rejectattr",
    "replace",
    "reverse",
    "round",
    "select",
    "selectattr",
    "slice",
    "sort",
    "string",
    "sum",
    "title",
    "trim",
    "truncate",
    "unique",
    "upper",
    "wordcount",
    "wordwrap",
]
_BUILT = (str, bytes, list, tuple, dict)


def _center(value: Any, width: int = 80) -> str:
    if is_int(width):
        refuse_past_bound(width, "the `center` filter")
    return jinja_filters.do_center(value, width)


def _indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    text = str(s)
    pad = len(width) if isinstance(width, str) else width if is_int(width) else 0
    refuse_past_bound(len(text) + (text.count("\n") + 1) * pad, "the `indent` filter")
    return jinja_filters.do_indent(text, width, first, blank)


@jinja2.pass_environment
def _wordwrap(
    environment: jinja2.Environment,
    s: Any,
    width: int = 79,
    break_long_words: bool = True,
    wrapstring: str | None = None,
    break_on_hyphens: bool = True,
) -> str:
    text = str(s)
    line_end = environment.newline_sequence if wrapstring is None else str(wrapstring)
    refuse_past_bound(len(text) * (1 + len(line_end)), "the `wordwrap` filter")
    return jinja_filters.do_wordwrap(environment, text, width, break_long_words, wrapstring, break_on_hyphens)


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    check_printf(str(value), kwargs or args)
    return jinja_filters.do_format(value, *args, **kwargs)


@jinja2.pass_eval_context
def _join(eval_ctx: jinja2.nodes.EvalContext, value: Iterable[Any], d: str = "", attribute: Any = None) -> str:
    items = list(value)
    refuse_past_bound(size_of(items) + len(str(d)) * len(items), "the `join` filter")
    return jinja_filters.sync_do_join(eval_ctx, items, d, attribute)


@jinja2.pass_eval_context
def _replace(eval_ctx: jinja2.nodes.EvalContext, s: Any, old: Any, new: Any, count: int | None = None) -> str:
    text, old_text, new_text = str(s), str(old), str(new)
    occurrences = text.count(old_text) if old_text else len(text) + 1
    refuse_past_bound(len(text) + occurrences * len(new_text), "the `replace` filter")
    return jinja_filters.do_replace(eval_ctx, s, old, new, count)


def _batch(value: Iterable[Any], linecount: int, fill_with: Any = None) -> Iterator[list[Any]]:
    if is_int(linecount):
        refuse_past_bound(linecount, "the `batch` filter")
    return jinja_filters.do_batch(value, linecount, fill_with)


@jinja2.pass_environment
def _sum(environment: jinja2.Environment, iterable: Iterable[Any], attribute: Any = None, start: Any = 0) -> Any:
    if not isinstance(start, int | float):  # sum() of lists copies them all again at each item
        raise TemplateBoundError("the `sum` filter adds numbers only")
    return jinja_filters.sync_do_sum(environment, iterable, attribute, start)


def _title(s: Any) -> str:
    text = str(s)
    if len(text) > MAX_TITLE_CHARS:
        raise TemplateBoundError(f"the `title` filter takes at most {MAX_TITLE_CHARS} characters")
    return jinja_filters.do_title(text)


def _round(value: Any, precision: int = 0, method: str = "common") -> float:
    if is_int(precision) and abs(precision) > MAX_ROUND_DIGITS:
        raise TemplateBoundError(f"the `round` filter's precision must be within ±{MAX_ROUND_DIGITS}")
    return jinja_filters.do_round(value, precision, method)


def _slice(value: Iterable[Any], slices: int, fill_with: Any = None) -> Iterator[list[Any]]:
    if is_int(slices) and slices > MAX_SLICES:
        raise TemplateBoundError(f"the `slice` filter makes at most {MAX_SLICES} slices")
    return jinja_filters.sync_do_slice(value, slices, fill_with)  # type: ignore[arg-type]


@jinja2.pass_environment
def _sort(
    environment: jinja2.Environment,
    value: Iterable[Any],
    reverse: bool = False,
    case_sensitive: bool = False,
    attribute: Any = None,
) -> list[Any]:
    items = list(value)
    if len(items) > MAX_SORT_ITEMS:
        raise TemplateBoundError(f"the `sort` filter sorts at most {MAX_SORT_ITEMS} items, not {len(items)}")
    return jinja_filters.sync_do_sort(environment, items, reverse, case_sensitive, attribute)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as Hugging Face's templates expect it (transformers' ``tojson``): not HTML-escaped, non-ASCII kept."""
    if indent is not None and not (is_int(indent) and 0 <= indent <= MAX_JSON_INDENT):
        raise TemplateBoundError(f"tojson's indent must be a number of spaces from 0 to {MAX_JSON_INDENT}")
    if separators is not None and sum(len(str(part)) for part in separators) > MAX_JSON_INDENT:
        raise TemplateBoundError(f"tojson's separators may hold {MAX_JSON_INDENT} characters in all")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_BOUNDED: dict[str, Callable[..., Any]] = {
    "center": _center,
    "indent": _indent,
    "wordwrap": _wordwrap,
    "format": _format,
    "join": _join,
    "replace": _replace,
    "batch": _batch,
    "sum": _sum,
    "round": _round,
    "title": _title,
    "slice": _slice,
    "sort": _sort,
    "tojson": _tojson,
}


def _charged(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with the render's clock checked before it runs and its result charged to the render."""

    @functools.wraps(function)  # keeps Jinja's pass_context/pass_environment mark
    def charged(*args: Any, **kwargs: Any) -> Any:
        check_clock()
        result = function(*args, **kwargs)
        if isinstance(result, _BUILT):
            charge(size_of(result), f"the `{name}` filter")
        return result

    return charged


OFFERED_FILTERS: dict[str, Callable[..., Any]] = {
    name: _charged(name, _BOUNDED.get(name) or DEFAULT_FILTERS[name]) for name in (*_OFFERED_NAMES, "tojson")
}
