"""Operations: readiness when the database is gone, and log lines that carry the request id."""

from __future__ import annotations

import json
import logging

import pytest

from app.db.database import Database
from app.observability.log_format import JsonLogFormatter
from app.web.request_context import RequestIdLogFilter
from tests.app.gateway_fixtures import chat_body, gateway_client, make_tenant

pytestmark = pytest.mark.anyio


async def test_ready_says_degraded_naming_the_database_when_it_does_not_answer(
    gateway_settings, default_engine
) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        assert (await client.get("/ready")).status_code == 200
        unreachable = Database("postgresql://postgres@/loraplex?host=/nonexistent-socket-dir")
        working, gateway.database = gateway.database, unreachable
        try:
            response = await client.get("/ready")
        finally:
            gateway.database = working
            await unreachable.close()
        assert response.status_code == 200, "the model still serves: a load balancer keeps routing here"
        assert response.json() == {"status": "degraded", "checks": {"model": True, "database": False}}


async def test_log_lines_carry_the_request_id_of_their_response(gateway_settings, default_engine, caplog) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        caplog.handler.addFilter(RequestIdLogFilter())
        with caplog.at_level(logging.INFO):
            response = await client.post(
                "/v1/chat/completions", json=chat_body(default_engine.model_name, max_tokens=2), headers=acme.headers
            )
        assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    (record,) = [r for r in caplog.records if r.name == "app.openai.chat.runs"]
    assert record.request_id == request_id
    line = json.loads(JsonLogFormatter().format(record))
    assert line["request_id"] == request_id and request_id in line["message"] and line["level"] == "info"


async def test_openapi_schema_documents_every_route_with_examples(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, _):
        schema = (await client.get("/schema/openapi.json")).json()
    components = schema["components"]["schemas"]

    def has_example(content: dict) -> bool:
        target = content.get("schema", {})
        ref = target.get("$ref") or next((part["$ref"] for part in target.get("allOf", []) if "$ref" in part), None)
        component = components.get(ref.rsplit("/", 1)[-1], {}) if ref else {}
        return any(key in place for place in (content, target, component) for key in ("example", "examples"))

    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            where = f"{method.upper()} {path}"
            assert operation.get("summary") and operation.get("description"), f"{where} has no summary or description"
            for content in operation.get("requestBody", {}).get("content", {}).values():
                assert has_example(content), f"{where}: request body without an example"
            for status, response in operation["responses"].items():
                for media_type, content in response.get("content", {}).items():
                    if media_type == "application/json":
                        assert has_example(content), f"{where}: {status} response without an example"


async def test_openapi_schema_shows_the_sampling_and_logprob_parameters(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, _):
        schema = (await client.get("/schema/openapi.json")).json()
    components = schema["components"]["schemas"]
    shared = {
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "min_p",
        "top_k",
        "stop_token_ids",
        "ignore_eos",
        "best_of",
        "seed",
    }
    wanted = {
        "ChatCompletionRequest": shared | {"logprobs", "top_logprobs", "store", "metadata", "service_tier"},
        "CompletionRequest": shared | {"logprobs", "echo", "prompt_logprobs", "suffix"},
    }
    for name, params in wanted.items():
        (key,) = [key for key in components if key.rsplit(".", 1)[-1].rsplit("_", 1)[-1] == name]
        assert params <= set(components[key]["properties"]), params - set(components[key]["properties"])
