"""/v1/responses on the real default model: the official client's create and stream, metering, and the 400s."""

from __future__ import annotations

import json

import openai
import pytest

from tests.app.gateway_fixtures import TenantKey, gateway_client, make_tenant, usage_rows
from tests.app.live_server import LiveServer

pytestmark = pytest.mark.default_model

RESPONSES = "/v1/responses"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"enum": ["France", "Italy", "Spain"]}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def test_official_client_creates_and_streams_responses(server: LiveServer, acme: TenantKey, default_engine) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=acme.key, max_retries=0)
    model = default_engine.model_name
    plain = client.responses.create(model=model, input="What is the capital of France?", max_output_tokens=8)
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.output_text and plain.usage.output_tokens == 8 and plain.id.startswith("resp_")

    told = client.responses.create(
        model=model,
        instructions="Answer in JSON.",
        input=[{"role": "user", "content": "Where is Paris?"}],
        max_output_tokens=48,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}},
    )
    assert told.status == "completed"
    assert json.loads(told.output_text)["country"] in {"France", "Italy", "Spain"}

    kinds, text = [], ""
    answer = {"type": "json_schema", "name": "place", "schema": SCHEMA}  # so that it completes within its tokens
    with client.responses.stream(
        model=model, input="Where is Rome?", max_output_tokens=64, text={"format": answer}
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert text and final.output_text == text and final.usage.output_tokens > 0
    events = list(client.responses.create(model=model, input="Count to ten.", max_output_tokens=4, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 4
    assert [event.sequence_number for event in events] == list(range(len(events)))

    rows = server.run(usage_rows(server.gateway))  # one row per request
    assert [row.status for row in rows] == ["ok"] * 4
    assert rows[0].completion_tokens == 8 and rows[0].prompt_tokens == plain.usage.input_tokens
    assert rows[0].finish_reason == "length" and rows[2].completion_tokens == final.usage.output_tokens


@pytest.mark.anyio
async def test_metadata_at_openais_bounds_is_stored_and_returned(gateway_settings, default_engine) -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = {"model": default_engine.model_name, "input": "Hi", "max_output_tokens": 1, "metadata": metadata}
        created = await client.post(RESPONSES, json=body, headers=acme.headers)
        assert created.status_code == 200, created.text
        stored = await client.get(f"{RESPONSES}/{created.json()['id']}", headers=acme.headers)
        assert stored.json()["metadata"] == metadata


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "f", "parameters": "no"}]}, "tools[0].parameters"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text"),
        ({"input": []}, "input"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),  # OpenAI's bounds: 16 pairs,
        ({"metadata": {"k" * 65: "v"}}, "metadata"),  # keys of 64 characters,
        ({"metadata": {"k": "v" * 513}}, "metadata[...]"),  # values of 512
    ],
)
async def test_what_is_not_offered_is_a_400(gateway_settings, default_engine, fields, param) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = {"model": default_engine.model_name, "input": "Hi", "max_output_tokens": 4} | fields
        response = await client.post(RESPONSES, json=body, headers=acme.headers)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert await usage_rows(gateway) == []


@pytest.mark.anyio
async def test_another_tenants_adapter_is_not_found(gateway_settings, default_engine, tenant_adapters) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        await make_tenant(gateway, "owner", adapters={"alpha": tenant_adapters["alpha"]})
        stranger = await make_tenant(gateway, "stranger")
        body = {"model": "alpha", "input": "Hi", "max_output_tokens": 4}
        response = await client.post(RESPONSES, json=body, headers=stranger.headers)
        assert response.status_code == 404, response.text
