"""Admin changes to one adapter in quick succession hold in their order, however late the announcements arrive.

A replica applies its own change before answering and hears its announcement later, through PostgreSQL; these
tests make every announcement arrive ``LATE_S`` late (the listener waits before applying each), as it can on a
loaded machine, and check that no late announcement undoes a later change: on the replica that made both, and
on another replica, whose engine is the second one started here. A pin whose adapter leaves the engine between
its registration and its pin registers it again, pinned: never a 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.adapters.announcements import AdapterAnnouncements
from app.engine_clients.thread import LocalEngineClient
from app.keys.service import Scope
from app.services import Gateway
from app.settings import Settings
from tests.app.gateway_fixtures import TenantKey, gateway_client, make_tenant, start_default_engine
from tests.app.gateway_fixtures import test_settings as replica_settings
from tests.app.test_adapter_announcements import SHARED_KEY_SECRET, engine_pinned
from tests.app.test_admin_adapters import upload

pytestmark = pytest.mark.anyio

LATE_S = 0.3  # every announcement is applied this long after it arrives
SETTLE_S = 4 * LATE_S  # long enough for every announcement of a test to be applied


def make_late(announcements: AdapterAnnouncements, monkeypatch: pytest.MonkeyPatch) -> None:
    """Apply each announcement ``LATE_S`` after it arrives (in order, as ever)."""
    apply = announcements._apply

    async def late(payload: str) -> None:
        await asyncio.sleep(LATE_S)
        await apply(payload)

    monkeypatch.setattr(announcements, "_apply", late)


async def uploaded_alpha(
    client: httpx.AsyncClient, gateway: Gateway, folders: dict[str, Path]
) -> tuple[TenantKey, str]:
    """An admin key, and the id of the adapter ``alpha`` uploaded with it for a new tenant ``acme``."""
    admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
    acme = await make_tenant(gateway, "acme")
    adapter = (await upload(client, admin, acme.tenant_id, "alpha", folders["alpha"])).json()
    return admin, adapter["id"]


@pytest.fixture(scope="module")
def other_engine(data_home: Path) -> Iterator[LocalEngineClient]:
    """The second replica's own engine on the default model."""
    client = start_default_engine(data_home)
    yield client
    asyncio.run(client.stop())


async def test_own_late_unload_announcements_undo_neither_a_load_nor_a_pin(
    gateway_settings, default_engine, tenant_adapters, monkeypatch
):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        make_late(gateway.announcements, monkeypatch)
        admin, name = await uploaded_alpha(client, gateway, tenant_adapters)
        url = f"/admin/adapters/{name}"

        assert (await client.post(f"{url}/unload", headers=admin.headers)).status_code == 200
        assert (await client.post(f"{url}/load", headers=admin.headers)).json()["loaded"] is True
        await asyncio.sleep(SETTLE_S)
        assert default_engine.has_adapter(name), "the unload, heard late, removed the adapter loaded after it"

        assert (await client.post(f"{url}/unload", headers=admin.headers)).status_code == 200
        pinned = await client.post(f"{url}/pin", headers=admin.headers)
        assert pinned.status_code == 200, pinned.text
        await asyncio.sleep(SETTLE_S)
        assert engine_pinned(default_engine, name), "the unload, heard late, removed the adapter pinned after it"

        assert (await client.post(f"{url}/pin", json={"pinned": False}, headers=admin.headers)).status_code == 200
        assert (await client.post(f"{url}/pin", headers=admin.headers)).status_code == 200
        await asyncio.sleep(SETTLE_S)
        assert engine_pinned(default_engine, name), "the unpin, heard late, undid the pin made after it"
        assert (await client.delete(url, headers=admin.headers)).status_code == 200  # no pin left in the engine


async def test_a_pin_after_another_replicas_unload_holds_on_both(
    tmp_path: Path, database_url: str, default_engine, other_engine, tenant_adapters, monkeypatch
):
    def settings(home: Path) -> Settings:
        return dataclasses.replace(replica_settings(home, database_url), key_secret=SHARED_KEY_SECRET)

    async with (
        gateway_client(settings(tmp_path / "a"), default_engine) as (client_a, gateway_a),
        gateway_client(settings(tmp_path / "b"), other_engine) as (client_b, gateway_b),
    ):
        make_late(gateway_a.announcements, monkeypatch)
        make_late(gateway_b.announcements, monkeypatch)
        admin, name = await uploaded_alpha(client_a, gateway_a, tenant_adapters)
        url = f"/admin/adapters/{name}"
        assert (await client_b.post(f"{url}/load", headers=admin.headers)).status_code == 200

        assert (await client_a.post(f"{url}/unload", headers=admin.headers)).status_code == 200
        pinned = await client_b.post(f"{url}/pin", headers=admin.headers)  # before B hears A's unload
        assert pinned.status_code == 200, pinned.text
        await asyncio.sleep(SETTLE_S)
        assert engine_pinned(other_engine, name), "A's unload, heard late, removed the adapter B pinned after it"
        assert (await client_a.get(url, headers=admin.headers)).json()["pinned"] is True
        # A heard B's pin after its own unload: not resident there, and its next registration is pinned.
        assert (await client_a.post(f"{url}/load", headers=admin.headers)).status_code == 200
        assert engine_pinned(default_engine, name)
        assert (await client_a.delete(url, headers=admin.headers)).status_code == 200


async def test_a_pin_registers_again_an_adapter_that_left_the_engine_meanwhile(
    gateway_settings, default_engine, tenant_adapters, monkeypatch
):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, name = await uploaded_alpha(client, gateway, tenant_adapters)
        url = f"/admin/adapters/{name}"
        residency = gateway.adapters.residency
        audited = residency._audited

        async def then_evicted(*args: object, **kwargs: object) -> object:
            """The pin is recorded; then the adapter leaves the engine (as an eviction or an unload would)."""
            out = await audited(*args, **kwargs)
            await default_engine.remove_adapter(name)
            return out

        monkeypatch.setattr(residency, "_audited", then_evicted)
        pinned = await client.post(f"{url}/pin", headers=admin.headers)
        assert pinned.status_code == 200, pinned.text
        assert engine_pinned(default_engine, name)
        unpinned = await client.post(f"{url}/pin", json={"pinned": False}, headers=admin.headers)
        assert unpinned.status_code == 200, unpinned.text  # removed again before the unpin: nothing to unpin
        assert not default_engine.has_adapter(name)
        assert (await client.delete(url, headers=admin.headers)).status_code == 200
