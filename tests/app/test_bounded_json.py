"""JSON a client sends nests at most MAX_JSON_DEPTH levels: deeper is a 400 that says so, never a 500."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from app.web.bounded_json import MAX_JSON_DEPTH, json_depth, parse_json
from app.web.errors import BadRequestError
from tests.app.gateway_fixtures import gateway_client, make_tenant

NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
OPENINGS = "[" * 100_000  # past every recursion limit


def _nested_schema(num_levels: int) -> str:
    """A tool's parameters schema ``num_levels`` objects deep, as JSON text."""
    return '{"type": "object", "properties": {"x": ' * num_levels + '{"type": "string"}' + "}}" * num_levels


def _chat_with_arguments(model: str, arguments: str) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": arguments}}
    return {
        "model": model,
        "messages": [
            {"role": "user", "content": "What time is it?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
        ],
        "tools": [NOW],
        "max_tokens": 1,
    }


def _raw_chat_with_parameters(model: str, parameters: str) -> bytes:
    tool = '{"type": "function", "function": {"name": "now", "parameters": ' + parameters + "}}"
    messages = '[{"role": "user", "content": "Hi"}]'
    return f'{{"model": {json.dumps(model)}, "messages": {messages}, "tools": [{tool}], "max_tokens": 1}}'.encode()


def _responses_with_arguments(model: str, arguments: str) -> dict[str, Any]:
    return {
        "model": model,
        "input": [
            {"role": "user", "content": "What time is it?"},
            {"type": "function_call", "call_id": "call_1", "name": "now", "arguments": arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "noon"},
        ],
        "tools": [{"type": "function", **NOW["function"]}],
        "max_output_tokens": 1,
        "store": False,
    }


@pytest.mark.anyio
@pytest.mark.default_model
async def test_json_nested_past_the_bound_is_a_400_that_says_so(gateway_settings, default_engine) -> None:
    model = default_engine.model_name
    too_deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        json_headers = {**acme.headers, "Content-Type": "application/json"}
        # (case, route, the body as bytes, words the message holds)
        cases = [
            ("call-arguments", "/v1/chat/completions", _chat_with_arguments(model, OPENINGS), "`arguments`"),
            ("call-arguments-65", "/v1/chat/completions", _chat_with_arguments(model, too_deep), "`arguments`"),
            ("responses-arguments", "/v1/responses", _responses_with_arguments(model, OPENINGS), "`arguments`"),
            ("body", "/v1/chat/completions", _raw_chat_with_parameters(model, OPENINGS), "The request body"),
            ("body-100", "/v1/chat/completions", _raw_chat_with_parameters(model, _nested_schema(50)), "request body"),
        ]
        for case, route, body, words in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await client.post(route, content=content, headers=json_headers)
            assert response.status_code == 400, (case, response.status_code, response.text[:300])
            message = response.json()["error"]["message"]
            assert words in message and f"more than {MAX_JSON_DEPTH} levels" in message, (case, message)
        # At the bound, the same requests are served.
        at_bound = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
        for route, body in (
            ("/v1/chat/completions", _chat_with_arguments(model, at_bound)),
            ("/v1/responses", _responses_with_arguments(model, at_bound)),
        ):
            response = await client.post(route, json=body, headers=acme.headers)
            assert response.status_code == 200, (route, response.text[:300])


def _reference_depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_reference_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_reference_depth, value.values()), default=0)
    return 0


def _random_value(rng: random.Random, num_levels: int) -> Any:
    tricky = ['"', "\\", "[", "]", "{", "}", '\\"', "[[", '"]', "é", "\n", "x"]
    if num_levels == 0 or rng.random() < 0.2:
        return rng.choice(["".join(rng.choices(tricky, k=rng.randint(0, 6))), 1, None, 2.5, True])
    if rng.random() < 0.5:
        return [_random_value(rng, num_levels - 1) for _ in range(rng.randint(0, 3))]
    keys = ["".join(rng.choices(tricky, k=rng.randint(0, 4))) for _ in range(rng.randint(0, 3))]
    return {key: _random_value(rng, num_levels - 1) for key in keys}


def test_the_depth_is_measured_outside_strings_as_a_walk_of_the_value_measures_it() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        value = _random_value(rng, rng.randint(0, 12))
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
            assert json_depth(text) == _reference_depth(value), text
            assert json_depth(text.encode()) == _reference_depth(value), text


def test_parse_json_refuses_past_the_bound_and_reads_what_is_within_it() -> None:
    value = parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "x")
    assert _reference_depth(value) == MAX_JSON_DEPTH
    for text in ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), OPENINGS, '{"a":' * 5000):
        with pytest.raises(BadRequestError, match="more than 64 levels"):
            parse_json(text, "x")
    with pytest.raises(ValueError):
        parse_json("[1, ", "x")
