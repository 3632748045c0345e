"""The EBNF grammar of a pythonic call's keyword arguments (``city="Paris", days=3``) from a JSON schema.

Required properties come first, in the schema's order; optional ones may follow, any of them, each
``key=value``. A value has the Python spelling of its schema's type: strings double-quoted with JSON's
escapes (at most ``maxLength`` characters), ``True``/``False``/``None``, an ``enum``'s values exactly;
arrays, objects and untyped values are any Python literal. Spacing is fixed (``, `` between arguments),
so no run of whitespace can loop.
"""

from __future__ import annotations

import json
from typing import Any

_STRING_CHAR = r'([^"\\\r\n] | "\\" ["\\nrt])'
_GENERIC_RULES = r"""
py_string ::= "\"" ([^"\\\r\n] | "\\" ["\\nrt])* "\""
py_int ::= "-"? [0-9]+
py_number ::= "-"? [0-9]+ ("." [0-9]+)?
py_bool ::= "True" | "False"
py_value ::= py_string | py_number | py_bool | "None" | py_list | py_dict
py_list ::= "[" (py_value (", " py_value)*)? "]"
py_dict ::= "{" (py_string ": " py_value (", " py_string ": " py_value)*)? "}"
"""
_TYPED_VALUES = {"string": "py_string", "integer": "py_int", "number": "py_number", "boolean": "py_bool"}


def arguments_grammar(schema: dict[str, Any]) -> str:
    """The grammar (root: the arguments between the parentheses) of an arguments object's ``schema``."""
    properties: dict[str, Any] = schema.get("properties") or {}
    required = [name for name in properties if name in set(schema.get("required") or [])]
    optional = [name for name in properties if name not in required]
    rules = [f"arg_{i} ::= {json.dumps(name + '=')} {_value(properties[name])}" for i, name in enumerate(properties)]
    index = {name: i for i, name in enumerate(properties)}
    any_optional = " | ".join(f"arg_{index[name]}" for name in optional)
    if required:
        root = ' ", " '.join(f"arg_{index[name]}" for name in required)
        if optional:
            root += f' (", " ({any_optional}))*'
    elif optional:
        root = f'(({any_optional}) (", " ({any_optional}))*)?'
    else:
        root = '""'
    return "\n".join([f"root ::= {root}", *rules]) + _GENERIC_RULES


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
