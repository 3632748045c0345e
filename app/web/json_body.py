"""JSON request bodies checked strictly, as the OpenAPI schema states them, with errors that name the field.

Litestar converts a body leniently: ``"stream": 0`` becomes false and ``"max_tokens": "8"`` becomes 8, which
the schema does not allow and OpenAI's API refuses. A route with a JSON body therefore runs
``strict_json(BodyType)`` as its ``before_request`` hook: the body must decode as that type under msgspec's
strict rules, else the answer is a 400 naming the field. Litestar then parses the same (cached) bytes, which
can no longer be coerced into anything else. The body's nesting is bounded (app/web/bounded_json.py).

One difference from msgspec's rules is kept on purpose: JSON Schema counts ``8.0`` as an integer, and clients
that hold every number as a float (JavaScript's, some of Python's) send it so; Litestar reads it as 8.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from litestar import Request

from app.web.bounded_json import check_json_depth, nesting_error
from app.web.errors import BadRequestError

BODY = "The request body"

# msgspec's messages: "Object contains unknown field `x` - at `$.messages[0]`", "Expected `int`, got `str` - at `$.n`",
# "Expected `str` of length <= 64 - at `key` in `$.metadata`" (a key of an object)
_WHERE = re.compile(r" - at (?P<key>`key` in )?`\$\.?(?P<path>[^`]*)`$")
_FIELD = re.compile(r"`(?P<field>[^`]*)`")


def strict_json(body_type: type[msgspec.Struct]) -> Callable[[Request], Awaitable[None]]:
    """A ``before_request`` hook that refuses a body which is not exactly a ``body_type`` (400 naming the field)."""
    decoder = msgspec.json.Decoder(body_type)

    async def check_body(request: Request) -> None:
        raw = await request.body()
        if not raw.strip():
            raise BadRequestError("The request body is empty; send the parameters as a JSON object.")
        try:
            decoder.decode(raw)
        except msgspec.ValidationError:
            _check_with_integral_floats(raw, body_type)
        except msgspec.DecodeError as error:
            raise BadRequestError(f"The request body is not valid JSON ({error}); send a JSON object.") from None
        except RecursionError:
            raise nesting_error(BODY) from None
        check_json_depth(raw, BODY)  # fields typed Any (a tool's parameters) decode at any depth

    return check_body


def _check_with_integral_floats(raw: bytes, body_type: type[msgspec.Struct]) -> None:
    """Check the body again with every whole float (``8.0``) read as an integer; 400 if it still fails."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as error:  # the typed decoder stops at the first value it cannot take
        raise BadRequestError(f"The request body is not valid JSON ({error}); send a JSON object.") from None
    except RecursionError:
        raise nesting_error(BODY) from None
    check_json_depth(raw, BODY)  # before the walk below recurses through it
    try:
        msgspec.convert(_integral_floats_as_ints(value), body_type, strict=True)
    except msgspec.ValidationError as error:
        raise body_error(str(error)) from None


def _integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_as_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: _integral_floats_as_ints(item) for key, item in value.items()}
    return value


def body_error(text: str) -> BadRequestError:
    """A 400 for msgspec's validation message ``text``, with the field's path (``messages[0].role``) as ``param``."""
    where = _WHERE.search(text)
    path = where.group("path") if where else ""
    problem = text[: where.start()] if where else text
    field = _FIELD.search(problem)
    if field and problem.startswith(("Object contains unknown field", "Object missing required field")):
        name = f"{path}.{field.group('field')}" if path else field.group("field")
        if problem.startswith("Object contains unknown field"):
            return BadRequestError(
                f"Unsupported parameter: `{name}`. This server does not support it; remove it from the request.",
                param=name,
            )
        return BadRequestError(f"Missing required parameter: `{name}`.", param=name)
    if not path:
        return BadRequestError(f"The request body must be a JSON object of the documented fields: {problem}.")
    if where and where.group("key"):
        return BadRequestError(f"Invalid key in `{path}`: {problem}.", param=path)
    return BadRequestError(f"Invalid value for `{path}`: {problem}.", param=path)
