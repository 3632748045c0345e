"""How large a value a chat template builds, and the bounds the sandbox holds it to before building it.

A value's size is its characters (or bytes), or for a list, tuple, set or dict ``ITEM_SIZE`` for itself
and each of its items plus their sizes: about the bytes it takes (app/tool_calls/template_sandbox.py says
where the bounds are checked).
"""

from __future__ import annotations

import re
from itertools import chain, repeat
from typing import Any

MAX_VALUE_SIZE = 4 * 1024 * 1024  # characters: a prompt past 4 MiB fits no context this server serves
ITEM_SIZE = 8  # an item of a list or dict: the pointer to it (a dict's key and value are two)
MAX_INT_BITS = 1 << 16  # ~19700 decimal digits; Python refuses to print an int past 4300 anyway
MAX_JSON_INDENT = 64  # tojson's indent, in spaces; real templates use 2 or 4

_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?([diouxXeEfFgGcrsab%])")
_STRING_TYPES = (str, bytes, bytearray)
_SCALAR_TYPES = (int, float, type(None))
_SEQUENCE_TYPES = (list, tuple, set, frozenset)
_MEASURED_TYPES = (*_STRING_TYPES, *_SEQUENCE_TYPES, dict)


class TemplateBoundError(Exception):
    """An operation in a template would build a value past a bound; the message says which."""


def size_of(value: Any) -> int:
    """Characters of a string, or ``ITEM_SIZE`` per item plus their sizes for a container; stops past the bound.

    A level of nesting at a time, each measured by passes that run in C (a render's clock cannot stop a Python
    loop here, so none runs once per item): a list of 100,000 pairs costs a few passes, not 100,000 steps.
    """
    if isinstance(value, _STRING_TYPES):
        return len(value)
    if not isinstance(value, (*_SEQUENCE_TYPES, dict)):
        return 1
    total = 0
    levels = [[value]]  # lists of values each of whose own size is still to add
    while levels and total <= MAX_VALUE_SIZE:
        elements = levels.pop()
        if _all_are(elements, _SCALAR_TYPES):
            continue
        if _all_are(elements, _STRING_TYPES):
            total += sum(map(len, elements))
        elif _all_are(elements, _SEQUENCE_TYPES):
            total += ITEM_SIZE * (len(elements) + sum(map(len, elements)))
            if total <= MAX_VALUE_SIZE:
                levels.append(list(chain.from_iterable(elements)))
        elif _all_are(elements, dict):
            total += ITEM_SIZE * (len(elements) + 2 * sum(map(len, elements)))
            if total <= MAX_VALUE_SIZE:
                levels.append(list(chain.from_iterable(map(dict.keys, elements))))
                levels.append(list(chain.from_iterable(map(dict.values, elements))))
        else:  # mixed: a level for each kind, which the passes above then measure
            levels.append([item for item in elements if isinstance(item, _STRING_TYPES)])
            levels.append([item for item in elements if isinstance(item, _SEQUENCE_TYPES)])
            levels.append([item for item in elements if isinstance(item, dict)])
            total += sum(1 for item in elements if not isinstance(item, _MEASURED_TYPES))
    return total


def _all_are(elements: list[Any], types: type | tuple[type, ...]) -> bool:
    return all(map(isinstance, elements, repeat(types)))


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
