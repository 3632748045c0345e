"""Speculative decoding through the API: the same text and the same usage with it and without."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from app.db.tables import Adapter
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


async def test_metrics_count_proposed_and_accepted_tokens_by_adapter(
    gateway_settings, default_engine, tenant_adapters
) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme", adapters={"alpha": tenant_adapters["alpha"]})
        alpha_id = await _adapter_id(gateway, "alpha")
        before = _speculation_samples((await client.get("/metrics")).text)
        for model in (default_engine.model_name, "alpha"):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"Quote this back word for word: {PASSAGE}"}],
                "max_tokens": 40,
                "temperature": 0,
            }
            response = await client.post("/v1/chat/completions", json=body, headers=acme.headers)
            assert response.status_code == 200, response.text
        stats = await default_engine.stats()
        after = _speculation_samples((await client.get("/metrics")).text)
        for adapter in ("", alpha_id):  # "": the base model; an adapter by its engine name
            proposed = after[PROPOSED][adapter] - before[PROPOSED].get(adapter, 0.0)
            accepted = after[ACCEPTED][adapter] - before[ACCEPTED].get(adapter, 0.0)
            assert 0 < accepted <= proposed, (adapter, accepted, proposed)
            assert after[PROPOSED][adapter] == stats.num_proposed_tokens[adapter]
            assert after[ACCEPTED][adapter] == stats.num_accepted_tokens[adapter]
        (rate,) = after[RATE].values()
        assert rate == pytest.approx(sum(after[ACCEPTED].values()) / sum(after[PROPOSED].values()))
        assert rate == pytest.approx(stats.acceptance_rate)


PROPOSED, ACCEPTED = "loraplex_speculative_proposed_tokens", "loraplex_speculative_accepted_tokens"
RATE = "loraplex_speculative_acceptance_rate"


def _speculation_samples(text: str) -> dict[str, dict[str, float]]:
    """The three speculation series of a /metrics page: name -> adapter label ("" for the rate) -> value."""
    found: dict[str, dict[str, float]] = {PROPOSED: {}, ACCEPTED: {}, RATE: {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name][sample.labels.get("adapter", "")] = sample.value
    return found


async def _adapter_id(gateway, name: str) -> str:
    async with gateway.database.sessions() as session:
        return str(await session.scalar(select(Adapter.id).where(Adapter.name == name)))
