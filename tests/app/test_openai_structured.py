"""Structured output and tool calls on the real default model: what parses, what validates, what is refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.sampling.grammar import MAX_JSON_WHITESPACE
from tests.app.gateway_fixtures import chat_body, gateway_client, make_tenant, on_both_engines, sse_events, usage_rows

pytestmark = [pytest.mark.anyio, pytest.mark.default_model]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
COLOUR_SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}},
    "required": ["colour", "sure"],
}
# Room for the longest answer the grammar allows, so that each ends on its own ('stop'): about 15 tokens of JSON
# and its end, and up to MAX_JSON_WHITESPACE whitespace characters (a token each at worst) in each of its 10 gaps
# (8 inside the object, one before and one after it); temperature 1 samples some.
ENUM_MAX_TOKENS = 15 + 10 * MAX_JSON_WHITESPACE
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}


async def test_a_json_schema_with_an_enum_yields_one_of_its_values(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = chat_body(
            default_engine.model_name,
            "What colour is the sky?",
            n=3,
            temperature=1.0,
            seed=2,
            max_tokens=ENUM_MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": "sky", "schema": COLOUR_SCHEMA}},
        )
        response = await client.post(CHAT, json=body, headers=acme.headers)
        assert response.status_code == 200, response.text
        answer = response.json()
        for choice in answer["choices"]:
            assert choice["finish_reason"] == "stop"
            value = json.loads(choice["message"]["content"])
            jsonschema.validate(value, COLOUR_SCHEMA)
            assert value["colour"] in {"red", "green", "blue"}
        rows = await usage_rows(gateway)
        assert [row.completion_tokens for row in rows] == [answer["usage"]["completion_tokens"]]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_json_object_parses_whenever_it_stops(gateway_settings, default_engine, seed: int) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = chat_body(
            default_engine.model_name,
            "Describe a cat as JSON.",
            temperature=1.0,
            seed=seed,
            max_tokens=64,
            response_format={"type": "json_object"},
        )
        response = await client.post(CHAT, json=body, headers=acme.headers)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:
            assert choice["finish_reason"] == "length"


@on_both_engines
async def test_structured_outputs_choice_and_regex_on_both_routes(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        choices = ["positive", "negative"]
        chat = chat_body(default_engine.model_name, "I love it!", max_tokens=8, structured_outputs={"choice": choices})
        response = await client.post(CHAT, json=chat, headers=acme.headers)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] in choices
        completion = {
            "model": default_engine.model_name,
            "prompt": "The year is",
            "max_tokens": 8,
            "structured_outputs": {"regex": "[0-9]{4}"},
        }
        response = await client.post(COMPLETIONS, json=completion, headers=acme.headers)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert len(choice["text"]) == 4 and choice["text"].isdigit() and choice["finish_reason"] == "stop"


@on_both_engines
@pytest.mark.parametrize("stream", [False, True])
async def test_named_and_required_tool_calls_validate(gateway_settings, default_engine, stream: bool) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        for tool_choice, finish in (
            ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
            ("required", "tool_calls"),
        ):
            body = chat_body(
                default_engine.model_name,
                "What is the weather in Paris?",
                max_tokens=96,
                tools=[WEATHER, TIME],
                tool_choice=tool_choice,
                parallel_tool_calls=False,
                stream=stream,
            )
            response = await client.post(CHAT, json=body, headers=acme.headers)
            assert response.status_code == 200, response.text
            calls, reason = _calls(response.text, stream)
            assert reason == finish and len(calls) == 1
            for call in calls:
                assert call["id"].startswith("call_") and call["type"] == "function"
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
            if tool_choice != "required":
                assert calls[0]["function"]["name"] == "get_weather"


def _calls(text: str, stream: bool) -> tuple[list[dict], str]:
    """The tool calls of one answer and its finish reason, whole or reassembled from the stream's deltas."""
    if not stream:
        (choice,) = json.loads(text)["choices"]
        assert choice["message"]["content"] is None
        return choice["message"]["tool_calls"], choice["finish_reason"]
    calls: dict[int, dict] = {}
    reason = None
    for event in sse_events(text)[:-1]:
        (choice,) = json.loads(event)["choices"]
        assert not choice["delta"].get("content")
        for delta in choice["delta"].get("tool_calls", []):
            call = calls.setdefault(delta["index"], {"function": {"name": "", "arguments": ""}})
            call.update({key: delta[key] for key in ("id", "type") if key in delta})
            for key, value in delta.get("function", {}).items():
                call["function"][key] += value
        reason = choice["finish_reason"] or reason
    return [calls[i] for i in sorted(calls)], reason


async def test_a_conversation_with_tool_results_is_rendered_and_answered(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        }
        body = {
            "model": default_engine.model_name,
            "max_tokens": 16,
            "tools": [WEATHER],
            "tool_choice": "none",
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            ],
        }
        response = await client.post(CHAT, json=body, headers=acme.headers)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]


@on_both_engines
@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
            "cannot be compiled",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs `json_schema`"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "cannot be compiled"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
            "response_format",
            "send only one",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools",
            "must be an object schema",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among `tools`",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "unique"),
        ({"functions": [{"name": "f"}]}, "functions", "send them as `tools`"),
        ({"min_tokens": 2, "response_format": {"type": "json_object"}}, None, "min_tokens cannot be combined"),
    ],
)
async def test_bad_structured_requests_are_400s_that_cost_nothing(
    gateway_settings, default_engine, fields: dict, param: str | None, says: str
) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = chat_body(default_engine.model_name, "Hi", max_tokens=4) | fields
        response = await client.post(CHAT, json=body, headers=acme.headers)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert says in error["message"] and error["param"] == param
        assert await usage_rows(gateway) == []
