"""A tenant sees and uses its own adapters only; another tenant's adapter is the same 404 as none at all."""

from __future__ import annotations

import pytest

from tests.app.gateway_fixtures import chat_body, gateway_client, make_tenant, on_both_engines

pytestmark = pytest.mark.anyio

NOT_FOUND = "does not exist or you do not have access to it"


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
