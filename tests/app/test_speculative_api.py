"""Speculative decoding through the API: the same text and the same usage with it and without."""

from __future__ import annotations

import pytest

from tests.app.gateway_fixtures import gateway_client, make_tenant, usage_rows

pytestmark = pytest.mark.anyio

PASSAGE = (
    "A good bread needs only flour, water, salt and time. The dough is mixed, left to rest, folded every half hour "
    "and shaped before it proves overnight in a cool place."
)


async def test_usage_and_text_are_the_same_with_and_without_speculation(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        before = await default_engine.stats()
        body = {
            "model": default_engine.model_name,
            "messages": [{"role": "user", "content": f"Quote this back word for word: {PASSAGE}"}],
            "max_tokens": 40,
            "temperature": 0,
        }
        responses = [
            await client.post("/v1/chat/completions", json=body | extra, headers=acme.headers)
            for extra in ({"speculative": False}, {})
        ]
        after = await default_engine.stats()
        assert [r.status_code for r in responses] == [200, 200]
        off, on = (r.json() for r in responses)
        assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: the second hits the cache
        assert [on["usage"][c] for c in counts] == [off["usage"][c] for c in counts]
        rows = await usage_rows(gateway)
        assert [row.completion_tokens for row in rows] == [off["usage"]["completion_tokens"]] * 2
        # The second request proposed and accepted tokens; the usage above counts only the tokens returned.
        assert sum(after.num_accepted_tokens.values()) > sum(before.num_accepted_tokens.values())
        bad = await client.post("/v1/chat/completions", json=body | {"speculative": "no"}, headers=acme.headers)
        assert bad.status_code == 400 and "speculative" in bad.text
