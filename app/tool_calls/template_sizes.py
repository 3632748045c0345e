"""How large a value a chat template builds, and the bounds the sandbox holds it to before building it.

A value's size is its characters (or bytes), or for a list, tuple, set or dict ``ITEM_SIZE`` for itself
and each of its items plus their sizes: about the bytes it takes (app/tool_calls/template_sandbox.py says
where the bounds are checked).
"""

from __future__ import annotations

import re
from typing import Any

MAX_VALUE_SIZE = 4 * 1024 * 1024  # characters: a prompt past 4 MiB fits no context this server serves
ITEM_SIZE = 8  # an item of a list or dict: the pointer to it (a dict's key and value are two)
MAX_INT_BITS = 1 << 16  # ~19700 decimal digits; Python refuses to print an int past 4300 anyway
MAX_JSON_INDENT = 64  # tojson's indent, in spaces; real templates use 2 or 4

_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?([diouxXeEfFgGcrsab%])")
_STRING_TYPES = frozenset({str, bytes, bytearray})
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})


class TemplateBoundError(Exception):
    """An operation in a template would build a value past a bound; the message says which."""


def size_of(value: Any) -> int:
    """Characters of a string, or ``ITEM_SIZE`` per item plus their sizes for a container; stops past the bound."""
    total = 0
    stack = [value]
    while stack and total <= MAX_VALUE_SIZE:
        item = stack.pop()
        if isinstance(item, str | bytes | bytearray):
            total += len(item)
        elif isinstance(item, list | tuple | set | frozenset | dict):
            total += ITEM_SIZE * (1 + len(item) * (2 if isinstance(item, dict) else 1))
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
        raise TemplateBoundError(
            f"{what} would build a value of more than {MAX_VALUE_SIZE} characters (an item of a list or dict counts "
            f"as {ITEM_SIZE})"
        )


def check_int_bits(num_bits: int, what: str) -> None:
    if num_bits > MAX_INT_BITS:
        raise TemplateBoundError(f"{what} would build an integer of more than {MAX_INT_BITS} bits")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
                if any(is_int(value) and value > MAX_VALUE_SIZE for value in value_list):
                    refuse_past_bound(MAX_VALUE_SIZE + 1, "a `*` width in `%` formatting")
            elif number:
                refuse_past_bound(int(number), "a width or precision in `%` formatting")
    largest = max((size_of(value) for value in value_list), default=0)
    refuse_past_bound(len(template) + len(specs) * largest, "`%` formatting")
