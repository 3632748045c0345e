"""The OpenAI-compatible endpoints on the real default model and a real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from app.openai.chat.prompts import OFF_LOOP_CHARS
from tests.app.gateway_fixtures import chat_body, gateway_client, make_tenant, on_both_engines, sse_events, usage_rows

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


@on_both_engines
async def test_chat_completion_answers_with_usage_and_request_id(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = {
            "model": default_engine.model_name,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        response = await client.post(CHAT, json=body, headers=acme.headers)
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"]
        data = response.json()
        assert data["object"] == "chat.completion"
        assert data["choices"][0]["message"]["role"] == "assistant"
        assert data["choices"][0]["message"]["content"]
        assert data["usage"]["completion_tokens"] <= 8
        assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]


@on_both_engines
async def test_streamed_chat_ends_with_done_and_usage_chunk(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = {
            "model": default_engine.model_name,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        response = await client.post(CHAT, json=body, headers=acme.headers)
        assert response.status_code == 200, response.text
        events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 17}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"temperature": 3.5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # no tool_call_id
    ],
)
async def test_unsupported_or_bad_parameters_get_400_naming_them(gateway_settings, default_engine, extra, param):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        response = await client.post(CHAT, json=chat_body(default_engine.model_name, **extra), headers=acme.headers)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"].split("[")[0] == param  # a nested field comes with its path: messages[0].role
        assert error["type"] == "invalid_request_error"
        assert await usage_rows(gateway) == []  # refused before the engine: nothing to bill


@on_both_engines
async def test_prompt_plus_max_tokens_beyond_the_context_is_400(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = {"model": default_engine.model_name, "prompt": [1] * 10, "max_tokens": default_engine.max_model_len}
        response = await client.post("/v1/completions", json=body, headers=acme.headers)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert str(default_engine.max_model_len) in response.json()["error"]["message"]


@on_both_engines
async def test_completions_take_text_or_token_ids_and_usage_rows_match(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        model = default_engine.model_name
        text = await client.post(
            "/v1/completions",
            json={"model": model, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0},
            headers=acme.headers,
        )
        ids = default_engine.encode_prompt("The capital of France is")
        tokens = await client.post(
            "/v1/completions",
            json={"model": model, "prompt": ids, "max_tokens": 5, "temperature": 0},
            headers=acme.headers,
        )
        assert text.status_code == tokens.status_code == 200
        assert text.json()["choices"][0]["text"] == tokens.json()["choices"][0]["text"]
        assert text.json()["object"] == "text_completion"
        rows = await usage_rows(gateway)
        assert len(rows) == 2
        for row, response in zip(rows, (text, tokens), strict=True):
            usage = response.json()["usage"]
            assert (row.prompt_tokens, row.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
            assert row.tenant_id == acme.tenant_id and row.adapter_id is None and row.status == "ok"
            assert row.model == model and row.finish_reason == "length" and row.ttft_ms > 0
            assert row.request_id == response.headers["x-request-id"]


async def test_stream_without_include_usage_has_no_usage_chunk(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        response = await client.post(CHAT, json=chat_body(default_engine.model_name, stream=True), headers=acme.headers)
        events = sse_events(response.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert all(chunk["choices"] and chunk.get("usage") is None for chunk in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        streamed = sum(1 for c in chunks if c["choices"][0]["delta"].get("content"))
        (row,) = await usage_rows(gateway)
        assert row.status == "ok" and 1 <= streamed <= row.completion_tokens <= 8


async def test_requests_reach_the_engine_as_their_tenant_with_its_weight(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        admin = await make_tenant(gateway, "admin", scopes=("admin",))
        patch = await client.patch(
            f"/admin/tenants/{acme.tenant_id}", json={"fair_share_weight": 4.0}, headers=admin.headers
        )
        assert patch.status_code == 200, patch.text
        await asyncio.sleep(1.1)  # the authenticator's cache: the new weight rides with the key within a second
        response = await client.post(CHAT, json=chat_body(default_engine.model_name), headers=acme.headers)
        assert response.status_code == 200
        stats = await default_engine.stats()
        served = stats.tenant_counters[str(acme.tenant_id)]
        assert served > 0
        assert default_engine.engine._weights[str(acme.tenant_id)] == 4.0  # the weight the step loop gave the engine


async def test_a_long_prompt_is_tokenized_off_the_event_loop_and_a_short_one_on_it(
    gateway_settings, default_engine, monkeypatch
) -> None:
    threads: list[str] = []
    encode_prompt = default_engine.encode_prompt

    def recording(prompt: str) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode_prompt(prompt)

    monkeypatch.setattr(default_engine, "encode_prompt", recording)
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        for prompt in ("One, two,", "one two three " * (OFF_LOOP_CHARS // 14 + 1)):
            body = {"model": default_engine.model_name, "prompt": prompt, "max_tokens": 1}
            response = await client.post("/v1/completions", json=body, headers=acme.headers)
            assert response.status_code == 200, response.text
    loop_thread = threading.current_thread().name
    assert threads[0] == loop_thread and threads[1] != loop_thread
