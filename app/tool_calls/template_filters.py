"""Jinja's filters that pad, fill or multiply, with the sizes they would build bounded before they run."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jinja2
from jinja2 import filters as jinja_filters

from app.tool_calls.template_sizes import TemplateBoundError, check_printf, is_int, refuse_past_bound, size_of


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


BOUNDED_FILTERS: dict[str, Callable[..., Any]] = {
    "center": _center,
    "indent": _indent,
    "wordwrap": _wordwrap,
    "format": _format,
    "join": _join,
    "replace": _replace,
    "batch": _batch,
    "sum": _sum,
}
