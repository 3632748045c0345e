"""A live server on loopback: the official openai client, a client that hangs up mid-stream, metrics."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import asyncpg
import httpx
import openai
import pytest

from tests.app.gateway_fixtures import TenantKey, chat_body, make_tenant, on_both_engines
from tests.app.live_server import LiveServer, live_server

WAIT_S = 10.0


@pytest.fixture
def server(gateway_settings, default_engine) -> Iterator[LiveServer]:
    with live_server(gateway_settings, default_engine) as running:
        yield running


def _tenant(server: LiveServer, name: str) -> TenantKey:
    return server.run(make_tenant(server.gateway, name))


def _usage(database_url: str, request_id: str) -> asyncpg.Record | None:
    """The usage row of ``request_id``, waiting for the writer (it flushes every 0.2 s)."""

    async def poll() -> asyncpg.Record | None:
        connection = await asyncpg.connect(database_url)
        try:
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                row = await connection.fetchrow("SELECT * FROM usage_events WHERE request_id = $1", request_id)
                if row is not None:
                    return row
                await asyncio.sleep(0.1)
            return None
        finally:
            await connection.close()

    return asyncio.run(poll())


def test_official_openai_client_non_streaming_and_streaming(server, database_url, default_engine) -> None:
    base_url = server.url
    acme = _tenant(server, "acme")
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=acme.key, max_retries=0)
    assert [m.id for m in client.models.list()] == [default_engine.model_name]

    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(
        model=default_engine.model_name, messages=question, max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8

    stream = client.chat.completions.create(
        model=default_engine.model_name,
        messages=question,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content  # greedy: the same answer either way
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens

    completion = client.completions.create(model=default_engine.model_name, prompt="One, two,", max_tokens=4)
    assert completion.choices[0].text

    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="someone-elses-adapter", messages=question, max_tokens=4)
    assert error.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="lpx_wrongkey_" + "x" * 43, max_retries=0).models.list()


@on_both_engines
def test_client_that_hangs_up_mid_stream_is_billed_as_cancelled(server, database_url, default_engine) -> None:
    base_url = server.url
    acme = _tenant(server, "acme")
    body = chat_body(default_engine.model_name, "Count from one to one hundred.", stream=True, max_tokens=200)
    with (
        httpx.Client(base_url=base_url, timeout=WAIT_S) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=acme.headers) as response,
    ):
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        received = 0
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                received += 1
            if received >= 3:
                break  # hang up: closing the response closes the connection

    row = _usage(database_url, request_id)
    assert row is not None, "no usage row for a request whose client went away"
    assert row["status"] == "cancelled"
    assert received <= row["completion_tokens"] < 200
    stats = server.run(server.gateway.engine.stats())
    assert stats.num_running == 0 and stats.num_waiting == 0  # the sequence was aborted and its pages freed
    assert stats.pages_by_owner.get("kv", 0) == 0


@on_both_engines
def test_metrics_health_and_ready(server, default_engine) -> None:
    base_url = server.url
    acme = _tenant(server, "acme")
    with httpx.Client(base_url=base_url, timeout=WAIT_S) as http:
        assert http.get("/health").json() == {"status": "ok"}
        ready = http.get("/ready")
        assert ready.status_code == 200 and ready.json()["checks"] == {"model": True, "database": True}
        assert http.post("/v1/chat/completions", json=chat_body(default_engine.model_name), headers=acme.headers)
        assert http.get("/v1/models", headers={"Authorization": "Bearer lpx_wrongkey_" + "x" * 43}).status_code == 401
        metrics = http.get("/metrics")
    assert metrics.status_code == 200
    text = metrics.text
    assert 'loraplex_requests_total{adapter="base",endpoint="chat.completions",status="ok",tenant="acme"} 1.0' in text
    assert 'loraplex_time_to_first_token_seconds_count{adapter="base",tenant="acme"} 1.0' in text
    assert "loraplex_completion_tokens_total" in text and "loraplex_queue_depth" in text
    assert 'loraplex_pool_pages{owner="free",worker="local"}' in text
    assert 'loraplex_resident_adapters{worker="local"}' in text
    assert 'loraplex_registered_adapters{worker="local"}' in text
    assert 'vllm:num_requests_running{worker="local"}' in text
    lora_info = r'vllm:lora_requests_info\{max_lora="\d+",running_lora_adapters="[^"]*",waiting_lora_adapters="[^"]*",'
    assert re.search(lora_info + r'worker="local"\} \d', text), "the router's gauge, with the engine's own stats"
    assert 'loraplex_error_responses_total{code="invalid_api_key",status="401"} 1.0' in text
    assert "loraplex_usage_records_pending " in text


def test_client_that_hangs_up_before_a_non_streamed_answer_is_billed_as_cancelled(
    server, database_url, default_engine
) -> None:
    acme = _tenant(server, "acme")
    # A raw completion of a count goes on counting: far longer than the client waits.
    body = {"model": default_engine.model_name, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 400, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, headers=acme.headers)  # gives up after half a second

    async def wait_for_row() -> tuple[str, int]:
        connection = await asyncpg.connect(database_url)
        try:
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                row = await connection.fetchrow("SELECT status, completion_tokens FROM usage_events")
                if row is not None:
                    return row["status"], row["completion_tokens"]
                await asyncio.sleep(0.1)
            raise AssertionError("no usage row for a request whose client went away")
        finally:
            await connection.close()

    status, completion_tokens = asyncio.run(wait_for_row())
    assert status == "cancelled" and completion_tokens < 400
    stats = server.run(server.gateway.engine.stats())
    assert stats.num_running == 0 and stats.num_waiting == 0
