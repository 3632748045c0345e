"""Stored responses on the real default model: kept per tenant, continued, listed, deleted, swept."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import openai
import pytest
from sqlalchemy import func, select, update

from app.db.tables import Adapter, StoredResponse
from app.settings import Settings, SettingsError
from tests.app.gateway_fixtures import TenantKey, gateway_client, make_tenant, usage_rows
from tests.app.live_server import LiveServer
from tests.app.test_admin_tenants import make_admin

pytestmark = pytest.mark.default_model

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def _client(server: LiveServer, tenant: TenantKey) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=tenant.key, max_retries=0)


def test_a_stored_response_is_continued_listed_and_deleted_by_its_tenant_only(
    server: LiveServer, acme: TenantKey, default_engine
) -> None:
    client, model = _client(server, acme), default_engine.model_name
    first = client.responses.create(model=model, input="My name is Ada.", max_output_tokens=6, temperature=0)
    assert first.store is True and client.responses.retrieve(first.id).model_dump() == first.model_dump()

    second = client.responses.create(
        model=model, input="What is my name?", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.total_tokens  # the first turn is in the prompt again
    items = client.responses.input_items.list(second.id, order="asc")
    assert [(item.type, getattr(item, "role", None)) for item in items.data] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert items.data[1].id == first.output[0].id and items.data[1].content[0].text == first.output_text
    assert items.data[2].content[0].text == "What is my name?" and items.has_more is False
    newest = client.responses.input_items.list(second.id, limit=1)  # desc by default: the new input first
    assert newest.data[0].id == items.data[2].id and newest.has_more is True and newest.last_id == items.data[2].id
    after = client.responses.input_items.list(second.id, limit=5, after=newest.last_id)
    assert [item.id for item in after.data] == [items.data[1].id, items.data[0].id]

    stranger = _client(server, server.run(make_tenant(server.gateway, "stranger")))
    for attempt in (
        lambda: stranger.responses.retrieve(first.id),
        lambda: stranger.responses.input_items.list(first.id),
        lambda: stranger.responses.delete(first.id),
        lambda: stranger.responses.create(model=model, input="Hi", previous_response_id=first.id, max_output_tokens=2),
        lambda: client.responses.retrieve("resp_unknown"),
    ):
        with pytest.raises(openai.NotFoundError) as refused:
            attempt()
        assert refused.value.status_code == 404 and "No stored response" in refused.value.message

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    assert client.responses.retrieve(second.id).output_text == second.output_text  # it keeps its own conversation

    unstored = client.responses.create(model=model, input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    rows = server.run(usage_rows(server.gateway))  # one row per generation; reads and deletes cost none
    assert len(rows) == 3 and rows[1].prompt_tokens == second.usage.input_tokens


def test_a_streamed_response_is_stored_before_its_last_event(
    server: LiveServer, acme: TenantKey, default_engine
) -> None:
    client, model = _client(server, acme), default_engine.model_name
    with client.responses.stream(model=model, input="Say hello.", max_output_tokens=4) as stream:
        for event in stream:
            if event.type in ("response.completed", "response.incomplete"):
                stored = client.responses.retrieve(event.response.id)  # while the stream is still open
                assert stored.output_text == event.response.output_text and stored.status == event.response.status


def test_function_tools_make_function_call_items_and_take_their_output(
    server: LiveServer, acme: TenantKey, default_engine
) -> None:
    client, model = _client(server, acme), default_engine.model_name
    asked = client.responses.create(
        model=model,
        input="What is the weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=32,
        temperature=0,
    )
    assert asked.status == "completed" and asked.tool_choice.name == "get_weather"
    calls = [item for item in asked.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert set(json.loads(calls[0].arguments)) == {"city"}

    answered = client.responses.create(
        model=model,
        previous_response_id=asked.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 degrees"}],
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert answered.output[0].type == "message" and answered.output_text
    kinds = [item.type for item in client.responses.input_items.list(answered.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"]

    events = list(
        client.responses.create(
            model=model,
            input="Weather in Rome?",
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=32,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    call = events[-1].response.output[-1]
    assert call.type == "function_call" and set(json.loads(call.arguments)) == {"city"}
    assert kinds[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and done.item_id == call.id


@pytest.mark.anyio
async def test_expired_responses_are_invisible_and_swept(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = {"model": default_engine.model_name, "input": "Hi", "max_output_tokens": 2}
        ids = [(await client.post("/v1/responses", json=body, headers=acme.headers)).json()["id"] for _ in range(2)]
        async with gateway.database.sessions() as session, session.begin():
            past = datetime.now(UTC) - timedelta(seconds=1)
            await session.execute(update(StoredResponse).where(StoredResponse.id == ids[0]).values(expires_at=past))
        assert (await client.get(f"/v1/responses/{ids[0]}", headers=acme.headers)).status_code == 404
        assert (await client.get(f"/v1/responses/{ids[1]}", headers=acme.headers)).status_code == 200
        assert await gateway.responses.store.sweep() == 1
        async with gateway.database.sessions() as session:
            assert await session.scalar(select(func.count()).select_from(StoredResponse)) == 1
            stored = await session.get(StoredResponse, ids[1])
        retention = stored.expires_at - stored.created_at
        assert abs(retention - timedelta(days=gateway_settings.response_retention_days)) < timedelta(seconds=5)


@pytest.mark.anyio
async def test_deleting_a_tenant_deletes_its_stored_responses_and_templates_at_once(
    gateway_settings, default_engine, tenant_adapters
) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme", adapters={"alpha": tenant_adapters["alpha"]})
        globex = await make_tenant(gateway, "globex")
        body = {"model": default_engine.model_name, "input": "My password is hunter2.", "max_output_tokens": 2}
        first = (await client.post("/v1/responses", json=body, headers=acme.headers)).json()
        continued = {**body, "input": "What is it?", "previous_response_id": first["id"]}
        second = (await client.post("/v1/responses", json=continued, headers=acme.headers)).json()
        kept = (await client.post("/v1/responses", json=body, headers=globex.headers)).json()
        async with gateway.database.sessions() as session, session.begin():
            await session.execute(
                update(Adapter).where(Adapter.tenant_id == acme.tenant_id).values(chat_template="{{ messages }}")
            )

        response = await client.delete(f"/admin/tenants/{acme.tenant_id}", headers=admin.headers)
        assert response.status_code == 200, response.text
        async with gateway.database.sessions() as session:
            stored = await session.scalars(select(StoredResponse.id).order_by(StoredResponse.id))
            assert list(stored) == [kept["id"]], "the deleted tenant's conversations are gone, no other's"
            templates = await session.scalars(select(Adapter.chat_template).where(Adapter.tenant_id == acme.tenant_id))
            assert list(templates) == [None]
        assert (await client.get(f"/v1/responses/{kept['id']}", headers=globex.headers)).status_code == 200

        # A response that finishes after its tenant's deletion is not stored.
        late = {**second, "id": "resp_finished_late"}
        assert not await gateway.responses.store.save(acme.tenant_id, late, [], None)
        async with gateway.database.sessions() as session:
            assert await session.get(StoredResponse, "resp_finished_late") is None


def test_the_retention_setting_is_read_within_its_range() -> None:
    assert Settings.from_env({}).response_retention_days == 30
    assert Settings.from_env({"LORAPLEX_RESPONSE_RETENTION_DAYS": "7"}).response_retention_days == 7
    for value, message in (("0", "1 to 3650"), ("3651", "1 to 3650"), ("week", "whole number")):
        with pytest.raises(SettingsError, match=message):
            Settings.from_env({"LORAPLEX_RESPONSE_RETENTION_DAYS": value})
