"""Jinja's immutable sandbox, with bounds on the values a template can build.

A template that writes a 4 MiB prompt is refused while it renders, but one expression can allocate far
more before anything is written: ``'x' * 10**10``, ``'a'.center(10**9)``, ``'%999999999d' % 1``,
``10**10**8``, or a string doubled by ``~`` in a loop. Each of these runs as one C call that no clock can
interrupt, so the sandbox checks its size before it runs. A value's size is its characters (or bytes),
or for a list, tuple or dict its items plus their sizes; no operation may build one past
``MAX_VALUE_SIZE``, the most a prompt may hold. Bounded here:

- the operators ``*`` (repetition), ``+`` and ``~`` (concatenation), ``%`` (printf formatting, its
  widths and precisions and the size of what it writes), and ``**`` and ``*`` on integers (at most
  ``MAX_INT_BITS`` bits);
- the string methods that pad, fill or multiply (``center``, ``ljust``, ``rjust``, ``zfill``,
  ``expandtabs``, ``join``, ``replace``, ``translate``) and ``format``/``format_map`` (widths and what
  they write);
- the filters that do the same (``center``, ``indent``, ``wordwrap``, ``format``, ``join``,
  ``replace``, ``batch``'s fill, ``sum``, ``tojson``'s indent). ``truncate`` writes no more than it is
  given, and ``range`` keeps Jinja's own cap of 100000 items.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable, Iterable, Iterator
from functools import update_wrapper
from typing import Any

import jinja2
from jinja2 import filters as jinja_filters
from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from markupsafe import Markup

MAX_VALUE_SIZE = 4 * 1024 * 1024  # characters or items: a prompt past 4 MiB fits no context this server serves
MAX_INT_BITS = 1 << 16  # ~19700 decimal digits; Python refuses to print an int past 4300 anyway
MAX_JSON_INDENT = 64  # tojson's indent, in spaces; real templates use 2 or 4

_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?([diouxXeEfFgGcrsab%])")
_DIGITS = re.compile(r"\d+")


_STRING_TYPES = frozenset({str, bytes, bytearray})
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})


class TemplateBoundError(Exception):
    """An operation in a template would build a value past a bound; the message says which."""


def size_of(value: Any) -> int:
    """Characters of a string, or items plus their sizes for a container; stops walking past the bound."""
    total = 0
    stack = [value]
    while stack and total <= MAX_VALUE_SIZE:
        item = stack.pop()
        if isinstance(item, str | bytes | bytearray):
            total += len(item)
        elif isinstance(item, list | tuple | set | frozenset | dict):
            total += 1 + len(item)
            if total > MAX_VALUE_SIZE:
                break
            elements = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            element_types = set(map(type, elements))  # one pass in C: most lists hold only strings or numbers
            if element_types <= _SCALAR_TYPES:
                continue
            if element_types <= _STRING_TYPES:
                total += sum(map(len, elements))
            else:
                stack.extend(elements)
        else:
            total += 1
    return total


def refuse_past_bound(size: int, what: str) -> None:
    if size > MAX_VALUE_SIZE:
        raise TemplateBoundError(f"{what} would build a value of more than {MAX_VALUE_SIZE} characters or items")


def _check_int_bits(num_bits: int, what: str) -> None:
    if num_bits > MAX_INT_BITS:
        raise TemplateBoundError(f"{what} would build an integer of more than {MAX_INT_BITS} bits")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_binop(operator: str, left: Any, right: Any) -> None:
    """TemplateBoundError if ``left operator right`` would build a value past a bound."""
    sequences = str | bytes | list | tuple
    if operator == "*":
        if isinstance(left, sequences) and _is_int(right):
            refuse_past_bound(size_of(left) * right, "`*` (repetition)")
        elif _is_int(left) and isinstance(right, sequences):
            refuse_past_bound(left * size_of(right), "`*` (repetition)")
        elif _is_int(left) and _is_int(right):
            _check_int_bits(left.bit_length() + right.bit_length(), "`*`")
    elif operator == "**":
        if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            _check_int_bits(left.bit_length() * right, "`**`")
    elif operator == "+":
        if isinstance(left, sequences) and isinstance(right, sequences):
            refuse_past_bound(size_of(left) + size_of(right), "`+`")
    elif operator == "%" and isinstance(left, str):
        check_printf(left, right)


def check_printf(template: str, values: Any) -> None:
    """TemplateBoundError if ``template % values`` has a width or precision, or writes, past the bound."""
    specs = _PRINTF_SPEC.findall(template)
    if not specs:
        return
    value_list = (
        list(values.values()) if isinstance(values, dict) else list(values) if isinstance(values, tuple) else [values]
    )
    for width, precision, _ in specs:
        for number in (width, precision):
            if number == "*":
                if any(_is_int(value) and value > MAX_VALUE_SIZE for value in value_list):
                    refuse_past_bound(MAX_VALUE_SIZE + 1, "a `*` width in `%` formatting")
            elif number:
                refuse_past_bound(int(number), "a width or precision in `%` formatting")
    largest = max((size_of(value) for value in value_list), default=0)
    refuse_past_bound(len(template) + len(specs) * largest, "`%` formatting")


def _check_format_spec(format_spec: str, what: str) -> None:
    for digits in _DIGITS.findall(format_spec):
        refuse_past_bound(int(digits), what)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def check_method_call(method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The call's arguments (an iterable to ``join`` made a list), or TemplateBoundError past a bound."""
    if not isinstance(method, types.BuiltinMethodType) or not isinstance(method.__self__, str | bytes):
        return args
    text, name = method.__self__, method.__name__
    if name in ("center", "ljust", "rjust", "zfill"):
        width = _argument(args, kwargs, 0, "width", 0)
        if _is_int(width):
            refuse_past_bound(width, f"`{name}`")
    elif name == "expandtabs":
        tab_size = _argument(args, kwargs, 0, "tabsize", 8)
        if _is_int(tab_size):
            refuse_past_bound(
                len(text) + text.count("\t" if isinstance(text, str) else b"\t") * tab_size, "`expandtabs`"
            )
    elif name == "join" and args:
        items = list(args[0])
        refuse_past_bound(size_of(items) + len(text) * len(items), "`join`")
        return (items, *args[1:])
    elif name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str | bytes) and isinstance(new, str | bytes):
            occurrences = text.count(old) if old else len(text) + 1
            refuse_past_bound(len(text) + occurrences * len(new), "`replace`")
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((size_of(value) for value in args[0].values()), default=1)
        refuse_past_bound(len(text) * longest, "`translate`")
    return args


class _BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, with each field's width and the whole output bounded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._size = 0

    def format_field(self, value: Any, format_spec: str) -> Any:
        _check_format_spec(format_spec, "a width or precision in `format`")
        refuse_past_bound(self._size + size_of(value), "`format`")
        formatted = super().format_field(value, format_spec)
        self._size += len(formatted)
        refuse_past_bound(self._size, "`format`")
        return formatted


class _BoundedEscapeFormatter(_BoundedFormatter, SandboxedEscapeFormatter):
    pass


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with ``~`` checked before it joins."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"environment.bounded_concat({join}, (")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


class BoundedSandboxedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with the operators, methods and filters that build large values bounded."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters.update(BOUNDED_FILTERS)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        args = check_method_call(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def bounded_concat(self, join: Callable[[Iterable[Any]], str], parts: tuple[Any, ...]) -> str:
        refuse_past_bound(sum(size_of(part) for part in parts), "`~`")
        return join(parts)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if not isinstance(value, types.MethodType | types.BuiltinMethodType) or value.__name__ not in (
            "format",
            "format_map",
        ):
            return None
        template = value.__self__
        if not isinstance(template, str):
            return None
        is_format_map = value.__name__ == "format_map"
        environment = self

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                kwargs, args = args[0], ()
            if isinstance(template, Markup):
                formatter: SandboxedFormatter = _BoundedEscapeFormatter(environment, escape=template.escape)
            else:
                formatter = _BoundedFormatter(environment)
            return type(template)(formatter.vformat(template, args, kwargs))

        return update_wrapper(wrapper, value)


def _center(value: Any, width: int = 80) -> str:
    if _is_int(width):
        refuse_past_bound(width, "the `center` filter")
    return jinja_filters.do_center(value, width)


def _indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    text = str(s)
    pad = len(width) if isinstance(width, str) else width if _is_int(width) else 0
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
    if _is_int(linecount):
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
