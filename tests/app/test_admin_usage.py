"""GET /admin/usage on a real PostgreSQL: sums per UTC day, tenant and adapter, filters, bounds, CSV, errors."""

from __future__ import annotations

import csv
import io
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, timezone

import pytest

from app.db.tables import Adapter, Tenant, UsageEvent
from app.keys.service import create_api_key
from app.services import Gateway
from tests.app.gateway_fixtures import gateway_client, make_tenant

pytestmark = pytest.mark.anyio

USAGE = "/admin/usage"
COLUMNS = [
    "day",
    "tenant_id",
    "tenant_name",
    "adapter_id",
    "adapter_name",
    "model",
    "requests",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "errors",
    "cancelled",
]
PLUS_TWO = timezone(timedelta(hours=2))


@dataclass(frozen=True, slots=True)
class Event:
    tenant: str
    adapter: str | None  # None: the base model
    started_at: datetime
    prompt: int
    cached: int
    completion: int
    status: str = "ok"


# Two tenants, three adapters (two of them named alike in different tenants), across four UTC days.
EVENTS = [
    Event("acme", None, datetime(2026, 3, 1, 9, 0, tzinfo=UTC), 10, 0, 3),
    Event("acme", None, datetime(2026, 3, 1, 23, 59, 59, tzinfo=UTC), 20, 5, 4),
    Event("acme", "support", datetime(2026, 3, 1, 12, 0, tzinfo=UTC), 7, 0, 0, "error"),
    Event("acme", "support", datetime(2026, 3, 2, 0, 0, tzinfo=UTC), 30, 10, 12),
    Event("acme", "support", datetime(2026, 3, 2, 8, 30, tzinfo=UTC), 31, 11, 13, "cancelled"),
    Event("acme", "legal", datetime(2026, 3, 2, 9, 0, tzinfo=UTC), 5, 0, 1),
    # 01:00 at UTC+2 is still 2 March in UTC: days are UTC days whatever offset a row was written with
    Event("globex", "support", datetime(2026, 3, 3, 1, 0, tzinfo=PLUS_TWO), 40, 0, 20),
    Event("globex", "support", datetime(2026, 3, 5, 18, 0, tzinfo=UTC), 50, 25, 30),
    Event("globex", None, datetime(2026, 3, 5, 19, 0, tzinfo=UTC), 60, 0, 31, "error"),
    Event("globex", None, datetime(2026, 3, 6, 0, 0, tzinfo=UTC), 70, 0, 32),
]


@dataclass(frozen=True, slots=True)
class Seeded:
    tenant_ids: dict[str, uuid.UUID]
    adapter_ids: dict[tuple[str, str], uuid.UUID]
    admin_headers: dict[str, str]
    inference_headers: dict[str, str]


async def seed(gateway: Gateway, events: list[Event]) -> Seeded:
    """Tenants, adapters and usage rows written straight to the tables, plus an admin and an inference key."""
    admin = await make_tenant(gateway, "admin", scopes=("admin",))
    user = await make_tenant(gateway, "user")
    tenant_ids: dict[str, uuid.UUID] = {}
    adapter_ids: dict[tuple[str, str], uuid.UUID] = {}
    async with gateway.database.sessions() as session, session.begin():
        for name in sorted({event.tenant for event in events}):
            tenant = Tenant(name=name)
            session.add(tenant)
            await session.flush()
            tenant_ids[name] = tenant.id
        for tenant_name, adapter_name in sorted({(e.tenant, e.adapter) for e in events if e.adapter}):
            adapter = Adapter(
                tenant_id=tenant_ids[tenant_name],
                name=adapter_name,
                base_model="base",
                rank=4,
                alpha=8.0,
                target_modules=["q_proj"],
                digest="0" * 64,
                size_bytes=1,
                storage_path="/nowhere",
            )
            session.add(adapter)
            await session.flush()
            adapter_ids[tenant_name, adapter_name] = adapter.id
        for event in events:
            session.add(
                UsageEvent(
                    request_id=uuid.uuid4().hex,
                    tenant_id=tenant_ids[event.tenant],
                    adapter_id=None if event.adapter is None else adapter_ids[event.tenant, event.adapter],
                    model=event.adapter or "base",
                    prompt_tokens=event.prompt,
                    cached_prompt_tokens=event.cached,
                    completion_tokens=event.completion,
                    status=event.status,
                    finish_reason="stop",
                    started_at=event.started_at,
                    finished_at=event.started_at + timedelta(seconds=1),
                )
            )
    return Seeded(tenant_ids, adapter_ids, admin.headers, user.headers)


def expected_rows(seeded: Seeded, events: list[Event], start: date, end: date) -> list[dict[str, object]]:
    """The report computed in Python from the events, in the order the API promises."""
    sums: dict[tuple[date, str, str | None], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for event in events:
        day = event.started_at.astimezone(UTC).date()
        if not start <= day <= end:
            continue
        row = sums[day, event.tenant, event.adapter]
        row["requests"] += 1
        row["prompt_tokens"] += event.prompt
        row["cached_prompt_tokens"] += event.cached
        row["completion_tokens"] += event.completion
        row["errors"] += event.status == "error"
        row["cancelled"] += event.status == "cancelled"
    rows = []
    for (day, tenant, adapter), counts in sums.items():
        adapter_id = None if adapter is None else str(seeded.adapter_ids[tenant, adapter])
        rows.append(
            {
                "day": day.isoformat(),
                "tenant_id": str(seeded.tenant_ids[tenant]),
                "tenant_name": tenant,
                "adapter_id": adapter_id,
                "adapter_name": adapter,
                "model": adapter or "base",
                **{name: counts[name] for name in COLUMNS[6:]},
            }
        )
    return sorted(rows, key=lambda row: (row["day"], row["tenant_name"], row["model"]))


async def test_rows_sum_each_utc_day_tenant_and_adapter(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        seeded = await seed(gateway, EVENTS)
        response = await client.get(
            USAGE, params={"start": "2026-03-01", "end": "2026-03-06"}, headers=seeded.admin_headers
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["start"] == "2026-03-01" and body["end"] == "2026-03-06"
        assert body["data"] == expected_rows(seeded, EVENTS, date(2026, 3, 1), date(2026, 3, 6))
        first = body["data"][0]
        # acme's two base-model requests on 1 March, the second one second before midnight UTC
        assert (first["day"], first["tenant_name"], first["adapter_name"], first["model"]) == (
            "2026-03-01",
            "acme",
            None,
            "base",
        )
        assert (first["requests"], first["prompt_tokens"], first["cached_prompt_tokens"]) == (2, 30, 5)
        globex_2nd = [row for row in body["data"] if row["day"] == "2026-03-02" and row["tenant_name"] == "globex"]
        assert [row["requests"] for row in globex_2nd] == [1]  # written at 01:00+02:00, counted on the UTC day
        assert sum(row["requests"] for row in body["data"]) == len(EVENTS)
        assert sum(row["errors"] for row in body["data"]) == 2
        assert sum(row["cancelled"] for row in body["data"]) == 1


async def test_bounds_are_inclusive_utc_days(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        seeded = await seed(gateway, EVENTS)
        for start, end in [(date(2026, 3, 2), date(2026, 3, 5)), (date(2026, 3, 6), date(2026, 3, 6))]:
            params = {"start": start.isoformat(), "end": end.isoformat()}
            response = await client.get(USAGE, params=params, headers=seeded.admin_headers)
            assert response.status_code == 200, response.text
            rows = response.json()["data"]
            assert rows == expected_rows(seeded, EVENTS, start, end)
            assert {row["day"] for row in rows} >= {start.isoformat(), end.isoformat()}  # both ends included
        empty = await client.get(
            USAGE, params={"start": "2026-03-07", "end": "2026-03-31"}, headers=seeded.admin_headers
        )
        assert empty.json() == {"data": [], "start": "2026-03-07", "end": "2026-03-31"}


async def test_filters_by_tenant_and_adapter(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        seeded = await seed(gateway, EVENTS)
        every_day = {"start": "2026-03-01", "end": "2026-03-06"}
        everything = expected_rows(seeded, EVENTS, date(2026, 3, 1), date(2026, 3, 6))

        globex = str(seeded.tenant_ids["globex"])
        response = await client.get(USAGE, params={**every_day, "tenant_id": globex}, headers=seeded.admin_headers)
        assert response.json()["data"] == [row for row in everything if row["tenant_id"] == globex]
        assert {row["tenant_name"] for row in response.json()["data"]} == {"globex"}

        # "support" names an adapter of each tenant; the filter is the adapter, not the name
        acme_support = str(seeded.adapter_ids["acme", "support"])
        response = await client.get(
            USAGE, params={**every_day, "adapter_id": acme_support}, headers=seeded.admin_headers
        )
        rows = response.json()["data"]
        assert rows == [row for row in everything if row["adapter_id"] == acme_support]
        assert sum(row["requests"] for row in rows) == 3

        both = {**every_day, "tenant_id": globex, "adapter_id": acme_support}
        assert (await client.get(USAGE, params=both, headers=seeded.admin_headers)).json()["data"] == []


async def test_default_range_is_the_last_30_days_up_to_today(gateway_settings, default_engine) -> None:
    today = datetime.now(UTC).replace(hour=0, minute=0, second=1, microsecond=0)
    events = [
        Event("acme", None, today, 1, 0, 1),
        Event("acme", None, today - timedelta(days=29), 2, 0, 1),  # the first day of the default range
        Event("acme", None, today - timedelta(days=30), 4, 0, 1),  # one day too old
    ]
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        seeded = await seed(gateway, events)
        response = await client.get(USAGE, headers=seeded.admin_headers)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["end"] == today.date().isoformat()
        assert body["start"] == (today.date() - timedelta(days=29)).isoformat()
        assert [row["prompt_tokens"] for row in body["data"]] == [2, 1]


async def test_csv_has_the_json_rows(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        seeded = await seed(gateway, EVENTS)
        params = {"start": "2026-03-01", "end": "2026-03-06"}
        as_json = (await client.get(USAGE, params=params, headers=seeded.admin_headers)).json()["data"]
        response = await client.get(USAGE, params={**params, "format": "csv"}, headers=seeded.admin_headers)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/csv")
        assert response.headers["content-disposition"] == 'attachment; filename="usage-2026-03-01-2026-03-06.csv"'
        lines = response.text.splitlines()
        assert lines[0] == ",".join(COLUMNS)
        assert len(lines) == 1 + len(as_json)
        as_csv = list(csv.DictReader(io.StringIO(response.text)))
        as_text = [{name: "" if value is None else str(value) for name, value in row.items()} for row in as_json]
        assert as_csv == as_text


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"start": "2026-03-05", "end": "2026-03-04"}, "start"),
        ({"start": "2025-01-01", "end": "2026-01-02"}, "start"),  # 367 days
        ({"start": "March 1st"}, "start"),
        ({"end": "2026-02-30"}, "end"),
        ({"format": "xml"}, "format"),
        ({"tenant_id": "acme"}, "tenant_id"),
        ({"adapter_id": "123"}, "adapter_id"),
    ],
)
async def test_bad_parameters_are_400_naming_the_parameter(gateway_settings, default_engine, params, param) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=("admin",))
        response = await client.get(USAGE, params=params, headers=admin.headers)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert param in error["message"]


async def test_a_range_of_366_days_is_allowed(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=("admin",))
        response = await client.get(USAGE, params={"start": "2024-01-01", "end": "2024-12-31"}, headers=admin.headers)
        assert response.status_code == 200, response.text


async def test_needs_an_admin_key(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        user = await make_tenant(gateway, "user")
        missing = await client.get(USAGE)
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        inference_only = await client.get(USAGE, headers=user.headers)
        assert inference_only.status_code == 403
        assert inference_only.json()["error"]["code"] == "insufficient_permissions"
        csv_too = await client.get(USAGE, params={"format": "csv"}, headers=user.headers)
        assert csv_too.status_code == 403


async def test_a_tenant_admin_gets_its_own_tenants_rows_only(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        seeded = await seed(gateway, EVENTS)
        acme, globex = str(seeded.tenant_ids["acme"]), str(seeded.tenant_ids["globex"])
        async with gateway.database.sessions() as session, session.begin():
            _, plaintext = await create_api_key(
                session,
                tenant_id=seeded.tenant_ids["acme"],
                name="ops",
                scopes=["tenant-admin"],
                key_secret=gateway.key_secret,
            )
        headers = {"Authorization": f"Bearer {plaintext}"}
        every_day = {"start": "2026-03-01", "end": "2026-03-06"}
        acme_rows = [
            row for row in expected_rows(seeded, EVENTS, date(2026, 3, 1), date(2026, 3, 6)) if row["tenant_id"] == acme
        ]
        assert acme_rows and len(acme_rows) < len(expected_rows(seeded, EVENTS, date(2026, 3, 1), date(2026, 3, 6)))
        for params in (every_day, {**every_day, "tenant_id": acme}):
            response = await client.get(USAGE, params=params, headers=headers)
            assert response.status_code == 200, response.text
            assert response.json()["data"] == acme_rows
        exported = await client.get(USAGE, params={**every_day, "format": "csv"}, headers=headers)
        assert {row["tenant_id"] for row in csv.DictReader(io.StringIO(exported.text))} == {acme}

        # Another tenant's rows: 404 as for a tenant that does not exist; its adapter's filter finds nothing.
        for tenant_id in (globex, str(uuid.uuid4())):
            refused = await client.get(USAGE, params={**every_day, "tenant_id": tenant_id}, headers=headers)
            assert refused.status_code == 404, refused.text
        theirs = str(seeded.adapter_ids["globex", "support"])
        response = await client.get(USAGE, params={**every_day, "adapter_id": theirs}, headers=headers)
        assert response.json()["data"] == []
