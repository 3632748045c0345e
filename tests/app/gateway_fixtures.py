"""A gateway over the real default model and a real PostgreSQL, and ways to make tenants and keys in it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from app.adapters.store import register_adapter
from app.db.tables import Tenant, UsageEvent
from app.engine_clients.interface import EngineClient
from app.engine_clients.process import ProcessEngineClient
from app.engine_clients.thread import LocalEngineClient
from app.factory import create_app
from app.keys.service import Scope, create_api_key
from app.model_store import resolve_model
from app.services import Gateway
from app.settings import DEFAULT_SPECULATIVE_TOKENS, Settings
from engine import EngineConfig

TEST_POOL_BYTES = 256 * 1024**2  # room for a few dozen short requests and a handful of adapters

# A test (or a module's pytestmark) with this mark runs once per engine client: on a thread, in a process.
on_both_engines = pytest.mark.parametrize("default_engine", ("thread", "process"), indirect=True)


def default_engine_config(home: Path) -> EngineConfig:
    folder = resolve_model("default", home)
    # Speculation on, as the server runs by default: every API test sees its outputs.
    return EngineConfig(
        model=str(folder),
        pool_bytes=TEST_POOL_BYTES,
        max_num_seqs=16,
        num_speculative_tokens=DEFAULT_SPECULATIVE_TOKENS,
        dtype="float32",
    )


def start_default_engine(home: Path) -> LocalEngineClient:
    """The default model's engine, started; its step loop runs on its own thread across event loops."""
    config = default_engine_config(home)
    client = LocalEngineClient(config, Path(config.model).name)
    asyncio.run(client.start())
    return client


def start_process_engine(home: Path) -> ProcessEngineClient:
    """The default model's engine in a worker process, started; it serves one event loop after another."""
    config = default_engine_config(home)
    client = ProcessEngineClient(config, Path(config.model).name)
    asyncio.run(client.start())
    return client


def test_settings(home: Path, database_url: str) -> Settings:
    return Settings(home=home, model="default", database_url=database_url, migrate_on_start=False, demo=False)


@dataclass(frozen=True, slots=True)
class TenantKey:
    tenant_id: uuid.UUID
    tenant_name: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@asynccontextmanager
async def gateway_client(settings: Settings, engine: EngineClient) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    """The app, its lifespan run on this event loop (where the test's own queries run too), and a client."""
    app = create_app(settings, engine=engine)
    async with (
        app.lifespan(),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client,
    ):
        yield client, app.state.gateway


async def make_tenant(
    gateway: Gateway,
    name: str,
    *,
    scopes: Sequence[str] = (Scope.INFERENCE,),
    expires_at: datetime | None = None,
    adapters: dict[str, Path] | None = None,
) -> TenantKey:
    async with gateway.database.sessions() as session, session.begin():
        tenant = Tenant(name=name)
        session.add(tenant)
        await session.flush()
        _, key = await create_api_key(
            session,
            tenant_id=tenant.id,
            name=f"{name}-key",
            scopes=scopes,
            key_secret=gateway.key_secret,
            expires_at=expires_at,
        )
        for adapter_name, folder in (adapters or {}).items():
            await register_adapter(
                session, gateway.engine, gateway.settings.home, tenant_id=tenant.id, name=adapter_name, source=folder
            )
    return TenantKey(tenant.id, name, key)


async def usage_rows(gateway: Gateway) -> list[UsageEvent]:
    """Every usage row, oldest first, after the writer has written what it holds."""
    await gateway.writer.flush()
    async with gateway.database.sessions() as session:
        return list(await session.scalars(select(UsageEvent).order_by(UsageEvent.id)))


def chat_body(model: str, content: str = "What is the capital of France?", **extra: object) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, in order."""
    return [block.removeprefix("data: ") for block in text.split("\n\n") if block.strip()]
