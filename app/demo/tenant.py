"""First start: a demo tenant with an inference key and the demo adapters, so one command shows it all.

Runs only when the database has no tenant yet (the admin tenant aside). The demo key's plaintext is
kept in the data folder (mode 0600) so that every later start can print a working example again, for
as long as that key exists and is not revoked.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select

from app.adapters.store import register_adapter
from app.admin.keys.first_admin import ADMIN_TENANT
from app.db.database import Database
from app.db.tables import Adapter, ApiKey, Tenant
from app.engine_clients.interface import EngineClient
from app.keys.secrets import hash_api_key
from app.keys.service import Scope, create_api_key

logger = logging.getLogger(__name__)

DEMO_TENANT = "demo"
DEMO_KEY_FILE = "demo-key"


@dataclass(frozen=True, slots=True)
class DemoAccess:
    """What the start banner shows: the demo key and the models it can use."""

    api_key: str
    adapters: tuple[str, ...]


async def ensure_demo_tenant(
    database: Database, engine: EngineClient, home: Path, key_secret: bytes, demo_adapters: dict[str, Path]
) -> DemoAccess | None:
    """Create the demo tenant on an empty database; the demo access if its key still works, else None."""
    async with database.sessions() as session, session.begin():
        # The `admin` tenant of `loraplex admin create-key` may already exist; any other tenant means the
        # database is in use and the demo is not wanted.
        if await session.scalar(select(func.count()).select_from(Tenant).where(Tenant.name != ADMIN_TENANT)) == 0:
            tenant = Tenant(name=DEMO_TENANT)
            session.add(tenant)
            await session.flush()
            _, plaintext = await create_api_key(
                session, tenant_id=tenant.id, name="demo", scopes=[Scope.INFERENCE], key_secret=key_secret
            )
            for name, folder in demo_adapters.items():
                await register_adapter(session, engine, home, tenant_id=tenant.id, name=name, source=folder)
            _write_private(home / DEMO_KEY_FILE, plaintext)
            logger.info("created the demo tenant with %d adapters", len(demo_adapters))
    return await _demo_access(database, home, key_secret)


async def _demo_access(database: Database, home: Path, key_secret: bytes) -> DemoAccess | None:
    key_file = home / DEMO_KEY_FILE
    if not key_file.is_file():
        return None
    plaintext = key_file.read_text().strip()
    query = (
        select(ApiKey.tenant_id)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(ApiKey.secret_hash == hash_api_key(key_secret, plaintext), ApiKey.revoked_at.is_(None))
        .where(Tenant.status == "active")
    )
    async with database.sessions() as session:
        tenant_id = await session.scalar(query)
        if tenant_id is None:
            return None

        names = await session.scalars(
            select(Adapter.name).where(Adapter.tenant_id == tenant_id, Adapter.status == "ready").order_by(Adapter.name)
        )
        return DemoAccess(api_key=plaintext, adapters=tuple(names))


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text + "\n")
