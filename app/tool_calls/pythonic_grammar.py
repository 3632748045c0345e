"""The EBNF grammar of a pythonic call's keyword arguments (``city="Paris", days=3``) from a JSON schema.

Required properties come first, in the schema's order; optional ones may follow, each at most once, in the
schema's order, each ``key=value``. A value has the Python spelling of its schema's type: strings
double-quoted with JSON's escapes (at most ``maxLength`` characters), numbers without leading zeros (Python
reads ``007`` as no number), ``True``/``False``/``None``, an ``enum``'s values exactly; arrays, objects and
untyped values are any Python literal. Spacing is fixed (``, `` between arguments), so no run of whitespace
can loop. A key is the property's name as it is, a Python keyword (``from``) or not an identifier
(``first-name``) alike: the parser (app/tool_calls/streaming.py) splits the arguments at the commas outside
strings and brackets and reads each name up to its ``=``, so a property whose name holds an ``=``, a comma,
a quote, a bracket or a backslash, or starts or ends with a space, cannot be read back and is left out (a
required one leaves the call unwritable: the grammar matches nothing).
"""

from __future__ import annotations

import json
from typing import Any

_STRING_CHAR = r'([^"\\\r\n] | "\\" ["\\nrt])'
_GENERIC_RULES = r"""
py_string ::= "\"" ([^"\\\r\n] | "\\" ["\\nrt])* "\""
py_int ::= "-"? ("0" | [1-9] [0-9]*)
py_number ::= py_int ("." [0-9]+)?
py_bool ::= "True" | "False"
py_value ::= py_string | py_number | py_bool | "None" | py_list | py_dict
py_list ::= "[" (py_value (", " py_value)*)? "]"
py_dict ::= "{" (py_string ": " py_value (", " py_string ": " py_value)*)? "}"
"""
_UNREADABLE = frozenset("=,\"'()[]{}\\")
_TYPED_VALUES = {"string": "py_string", "integer": "py_int", "number": "py_number", "boolean": "py_bool"}


def arguments_grammar(schema: dict[str, Any]) -> str:
    """The grammar (root: the arguments between the parentheses) of an arguments object's ``schema``."""
    properties: dict[str, Any] = schema.get("properties") or {}
    required_names = set(schema.get("required") or [])
    if any(not readable_name(name) for name in required_names if name in properties):
        return 'root ::= "=" "="' + _GENERIC_RULES  # no call: the key cannot be read back
    names = [name for name in properties if readable_name(name)]
    required = [name for name in names if name in required_names]
    optional = [name for name in names if name not in required_names]
    rules = [f"arg_{i} ::= {json.dumps(name + '=')} {_value(properties[name])}" for i, name in enumerate(names)]
    index = {name: i for i, name in enumerate(names)}
    # after_k: optional arguments k.. after some argument; first_k: the first of optional arguments k..
    for k, name in enumerate(optional):
        rules.append(f'after_{k} ::= (", " arg_{index[name]})? after_{k + 1}')
        rules.append(f"first_{k} ::= arg_{index[name]} after_{k + 1} | first_{k + 1}")
    rules += [f'after_{len(optional)} ::= ""', f'first_{len(optional)} ::= ""']
    root = ' ", " '.join(f"arg_{index[name]}" for name in required) + " after_0" if required else "first_0"
    return "\n".join([f"root ::= {root}", *rules]) + _GENERIC_RULES


def readable_name(name: str) -> bool:
    """Whether the parser reads ``name=`` back as the key ``name``."""
    return bool(name) and name == name.strip() and not _UNREADABLE & set(name)


def _value(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "py_value"
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "(" + " | ".join(json.dumps(_python_literal(v)) for v in schema["enum"]) + ")"
    kind = schema.get("type")
    if kind == "string" and isinstance(schema.get("maxLength"), int) and schema["maxLength"] >= 0:
        return f'("\\"" {_STRING_CHAR}{{0,{schema["maxLength"]}}} "\\"")'
    if kind == "null":
        return '"None"'
    return _TYPED_VALUES.get(kind, "py_value") if isinstance(kind, str) else "py_value"


def _python_literal(value: Any) -> str:
    """How Python writes a JSON value (strings as JSON writes them: Python reads them back alike)."""
    if value is True:
        return "True"
    if value is False:
        return "False"
    if value is None:
        return "None"
    return json.dumps(value)
