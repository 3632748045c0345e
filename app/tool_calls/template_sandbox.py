"""Jinja's immutable sandbox, with bounds on the values a template can build.

A template that writes a 4 MiB prompt is refused while it renders, but one expression can allocate far
more before anything is written: ``'x' * 10**10``, ``'a'.center(10**9)``, ``'%999999999d' % 1``,
``10 ** (10 ** 8)``, or a string doubled by ``~`` in a loop. Each of these runs as one C call that no clock can
interrupt, so the sandbox checks its size before it runs. A value's size is its characters (or bytes),
or for a list, tuple or dict its items plus their sizes; no operation may build one past
``MAX_VALUE_SIZE``, the most a prompt may hold. Bounded here:

- the operators ``*`` (repetition), ``+`` and ``~`` (concatenation), ``%`` (printf formatting, its
  widths and precisions and the size of what it writes), and ``**`` and ``*`` on integers (at most
  ``MAX_INT_BITS`` bits);
- the string methods that pad, fill or multiply (``center``, ``ljust``, ``rjust``, ``zfill``,
  ``expandtabs``, ``join``, ``replace``, ``translate``) and ``format``/``format_map`` (widths and what
  they write);
- the filters that do the same (app/tool_calls/template_filters.py: ``center``, ``indent``,
  ``wordwrap``, ``format``, ``join``, ``replace``, ``batch``'s fill, ``sum``), and ``tojson``'s indent.
  ``truncate`` writes no more than it is given, and ``range`` keeps Jinja's own cap of 100000 items.

Only the globals, filters and tests chat templates use are offered (``OFFERED_GLOBALS`` here, and
app/tool_calls/template_filters.py): nothing that prints a value's structure (``pprint``), makes text
(``lipsum``) or HTML (``urlize``, ``xmlattr``, the escapes) is. Every value a call, an operator, a filter, a
slice, a ``~`` or a macro's or block's body builds is charged to the render's budget, and each loop
iteration and call checks its clock (app/tool_calls/render_deadline.py).
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable, Iterable
from functools import update_wrapper
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from markupsafe import Markup

from app.tool_calls.render_deadline import charge, check_clock
from app.tool_calls.template_filters import OFFERED_FILTERS
from app.tool_calls.template_sizes import check_int_bits, check_printf, is_int, refuse_past_bound, size_of

_DIGITS = re.compile(r"\d+")
# Jinja's own globals a chat template may use (``range`` is the sandbox's, capped at 100000 items); the
# template module adds ``raise_exception`` and ``strftime_now``, as transformers does.
OFFERED_GLOBALS = ("range", "dict", "namespace", "cycler", "joiner")
_BUILT = (str, bytes, list, tuple, dict)  # the results whose size is charged to the render


def check_binop(operator: str, left: Any, right: Any) -> None:
    """TemplateBoundError if ``left operator right`` would build a value past a bound."""
    sequences = str | bytes | list | tuple
    if operator == "*":
        if isinstance(left, sequences) and is_int(right):
            refuse_past_bound(size_of(left) * right, "`*` (repetition)")
        elif is_int(left) and isinstance(right, sequences):
            refuse_past_bound(left * size_of(right), "`*` (repetition)")
        elif is_int(left) and is_int(right):
            check_int_bits(left.bit_length() + right.bit_length(), "`*`")
    elif operator == "**":
        if is_int(left) and is_int(right) and right > 0 and abs(left) > 1:
            check_int_bits(left.bit_length() * right, "`**`")
    elif operator == "+":
        if isinstance(left, sequences) and isinstance(right, sequences):
            refuse_past_bound(size_of(left) + size_of(right), "`+`")
    elif operator == "%" and isinstance(left, str):
        check_printf(left, right)


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
        if is_int(width):
            refuse_past_bound(width, f"`{name}`")
    elif name == "expandtabs":
        tab_size = _argument(args, kwargs, 0, "tabsize", 8)
        if is_int(tab_size):
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

    def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
        """A slice through ``environment.sliced`` (Jinja's own code slices directly, past every hook)."""
        if not isinstance(node.arg, nodes.Slice):
            super().visit_Getitem(node, frame)
            return
        self.write("environment.sliced(")
        self.visit(node.node, frame)
        self.write(", slice(")
        for index, part in enumerate((node.arg.start, node.arg.stop, node.arg.step)):
            self.write(", " if index else "")
            if part is None:
                self.write("None")
            else:
                self.visit(part, frame)
        self.write("))")


class BoundedSandboxedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with the operators, methods and filters that build large values bounded."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals = {name: self.globals[name] for name in OFFERED_GLOBALS}
        self.filters = dict(OFFERED_FILTERS)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """The template's tree, each loop's iterable read through :meth:`checked_iter`."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            checked = nodes.Call(nodes.EnvironmentAttribute("checked_iter"), [loop.iter], [], None, None)
            loop.iter = checked.set_lineno(loop.iter.lineno)
        return tree

    def checked_iter(self, iterable: Any) -> Iterable[Any]:
        """``iterable``'s items, the render's clock checked before each (a loop's body may hold no call)."""
        for item in iterable:
            check_clock()
            yield item

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, _BUILT):
            charge(size_of(result), f"`{operator}`")
        return result

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        check_clock()
        args = check_method_call(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, _BUILT) and not isinstance(__obj, Macro):  # a macro's body was charged as it ran
            charge(size_of(result), "a call")
        return result

    def sliced(self, obj: Any, key: slice) -> Any:
        result = obj[key]
        if isinstance(result, _BUILT):
            charge(size_of(result), "a slice")
        return result

    def bounded_concat(self, join: Callable[[Iterable[Any]], str], parts: tuple[Any, ...]) -> str:
        size = sum(size_of(part) for part in parts)
        refuse_past_bound(size, "`~`")
        charge(size, "`~`")
        return join(parts)

    def concat(self, parts: Iterable[Any]) -> str:  # type: ignore[override]  # Jinja's is a str.join
        """A macro's, a call block's or a ``{% set %}`` block's body joined, bounded and charged as ``~`` is."""
        parts = list(parts)
        size = sum(map(len, parts))
        refuse_past_bound(size, "a macro's or block's body")
        charge(size, "a macro's or block's body")
        return "".join(parts)

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
