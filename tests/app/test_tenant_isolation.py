"""A tenant sees and uses its own adapters only; another tenant's adapter is the same 404 as none at all."""

from __future__ import annotations

import dataclasses
import uuid

import httpx
import pytest

from tests.app.gateway_fixtures import TenantKey, chat_body, gateway_client, make_tenant, on_both_engines

pytestmark = pytest.mark.anyio

NOT_FOUND = "does not exist or you do not have access to it"
# A system prompt of some 150 tokens: several full blocks of 16, so a prefix-cache hit shows in cached_tokens.
SYSTEM_PROMPT = "You answer questions about the weather in short sentences, in English, politely. " * 10


async def _cached_tokens(client: httpx.AsyncClient, tenant: TenantKey, model: str, system: str) -> int:
    body = chat_body(model, "Is it sunny?", max_tokens=1)
    body["messages"] = [{"role": "system", "content": system}, *body["messages"]]  # type: ignore[misc]
    response = await client.post("/v1/chat/completions", json=body, headers=tenant.headers)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@on_both_engines
async def test_adapter_is_usable_and_listed_by_its_tenant_only(gateway_settings, default_engine, tenant_adapters):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme", adapters={"alpha": tenant_adapters["alpha"]})
        umbrella = await make_tenant(gateway, "umbrella", adapters={"beta": tenant_adapters["beta"]})

        models = (await client.get("/v1/models", headers=acme.headers)).json()
        assert [m["id"] for m in models["data"]] == [default_engine.model_name, "alpha"]
        models = (await client.get("/v1/models", headers=umbrella.headers)).json()
        assert [m["id"] for m in models["data"]] == [default_engine.model_name, "beta"]

        own = await client.post("/v1/chat/completions", json=chat_body("alpha"), headers=acme.headers)
        base = await client.post(
            "/v1/chat/completions", json=chat_body(default_engine.model_name), headers=acme.headers
        )
        assert own.status_code == base.status_code == 200
        assert own.json()["model"] == "alpha"
        assert own.json()["choices"][0]["message"]["content"] != base.json()["choices"][0]["message"]["content"]

        for path, body in (
            ("/v1/chat/completions", chat_body("alpha")),
            ("/v1/completions", {"model": "alpha", "prompt": "Hi", "max_tokens": 2}),
            ("/v1/chat/completions", chat_body("alpha", stream=True)),
        ):
            foreign = await client.post(path, json=body, headers=umbrella.headers)
            unknown = await client.post(path, json={**body, "model": "no-such-adapter"}, headers=umbrella.headers)
            assert foreign.status_code == unknown.status_code == 404
            assert foreign.json()["error"]["code"] == unknown.json()["error"]["code"] == "model_not_found"
            assert NOT_FOUND in foreign.json()["error"]["message"]
            assert foreign.json()["error"]["message"].replace("alpha", "X") == unknown.json()["error"][
                "message"
            ].replace("no-such-adapter", "X")


@on_both_engines
async def test_a_tenant_learns_nothing_from_another_tenants_cached_prefix(gateway_settings, default_engine):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme, umbrella = await make_tenant(gateway, "acme"), await make_tenant(gateway, "umbrella")
        system = f"{uuid.uuid4()} {SYSTEM_PROMPT}"  # a prefix no earlier test sent
        model = default_engine.model_name
        assert await _cached_tokens(client, acme, model, system) == 0
        assert await _cached_tokens(client, umbrella, model, system) == 0, "acme's prompt must not show"
        assert await _cached_tokens(client, acme, model, system) > 100, "a tenant still reuses its own prefixes"


async def test_the_operator_may_share_base_model_prefixes_across_tenants(gateway_settings, default_engine):
    settings = dataclasses.replace(gateway_settings, share_base_prefix_cache=True)
    async with gateway_client(settings, default_engine) as (client, gateway):
        acme, umbrella = await make_tenant(gateway, "acme"), await make_tenant(gateway, "umbrella")
        system = f"{uuid.uuid4()} {SYSTEM_PROMPT}"
        assert await _cached_tokens(client, acme, default_engine.model_name, system) == 0
        assert await _cached_tokens(client, umbrella, default_engine.model_name, system) > 100
