"""JSON a client sends, parsed with its nesting bounded: a value nested too deeply is a 400 that says so.

Python's and msgspec's decoders recurse once per level of arrays and objects and raise RecursionError past
the interpreter's limit (about a thousand levels), and every walk of the decoded value (templates, grammar
compilers, ``json.dumps``) recurses again; an assistant message's ``arguments`` of 100,000 ``[`` would be
a 500. Every JSON text a client sends (request bodies, a call's ``arguments``, an uploaded
``tokenizer_config.json``) is therefore decoded here, and refused past ``MAX_JSON_DEPTH`` levels.

The depth is measured on the text once it has decoded (so its strings are well formed): strings are cut out
by one regular expression, and the brackets left are summed in numpy, so a 4 MiB body costs milliseconds.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from app.web.errors import BadRequestError

# Levels of arrays and objects one JSON value may nest. A request body holds a JSON schema a few levels in
# (tools[].function.parameters, response_format.json_schema.schema), and OpenAI's structured outputs take
# schemas of at most 10 levels, each of which is two JSON levels (properties, then the property's schema).
MAX_JSON_DEPTH = 64

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # linear on decoded JSON: each string once
# Each byte to its step in depth: +1 opens an array or object, -1 (255 as int8) closes one, 0 anything else.
_STEPS = bytes(1 if byte in b"[{" else 255 if byte in b"]}" else 0 for byte in range(256))


def json_depth(text: str | bytes) -> int:
    """How deeply the arrays and objects of ``text``, a valid JSON text, nest (0 for a scalar)."""
    data = text.encode() if isinstance(text, str) else text
    steps = np.frombuffer(_STRING.sub(b"", data).translate(_STEPS), dtype=np.int8)  # [num_bytes]
    return int(steps.cumsum(dtype=np.int64).max(initial=0)) if steps.size else 0


def nesting_error(what: str, param: str | None = None) -> BadRequestError:
    return BadRequestError(
        f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep, the most taken; send a "
        "flatter value.",
        param=param,
    )


def check_json_depth(text: str | bytes, what: str, param: str | None = None) -> None:
    """A 400 naming ``what`` if ``text`` (valid JSON) nests past ``MAX_JSON_DEPTH``."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise nesting_error(what, param)


def parse_json(text: str | bytes, what: str, param: str | None = None) -> Any:
    """``text``'s JSON value; ValueError if it is not JSON, a 400 naming ``what`` if it nests too deeply."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise nesting_error(what, param) from None
    check_json_depth(text, what, param)
    return value
