"""Fixtures for the app's tests: one real PostgreSQL per session, migrated once, emptied per test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from app.db.migrate import upgrade
from tests.app.postgres import real_postgres, truncate_all


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated PostgreSQL for the whole session (LORAPLEX_TEST_DATABASE_URL picks an existing one)."""
    with real_postgres(tmp_path_factory.mktemp("postgres"), os.environ.get("LORAPLEX_TEST_DATABASE_URL")) as url:
        upgrade(url)
        yield url


@pytest.fixture
def database_url(postgres_url: str) -> str:
    """The session's database, emptied before the test so that each test starts from nothing."""
    truncate_all(postgres_url)
    return postgres_url
