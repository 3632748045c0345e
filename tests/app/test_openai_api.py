"""The OpenAI-compatible endpoints on the real default model and a real PostgreSQL."""

from __future__ import annotations

import json

import pytest

from tests.app.gateway_fixtures import gateway_client, make_tenant

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


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
