"""A real PostgreSQL for the app's tests: DATABASE_URL, else a container, else the embedded server.

Never SQLite and never a mock: the tables are a contract with billing jobs, so the tests run on the
database those jobs read.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import asyncpg

from app.db.embedded import EmbeddedPostgres

logger = logging.getLogger(__name__)

POSTGRES_IMAGE = "postgres:16-alpine"
TABLES = ("stored_responses", "usage_events", "audit_log", "adapter_files", "adapters", "api_keys", "tenants")


def docker_is_reachable() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "info"], capture_output=True, timeout=20, check=False)
    return probe.returncode == 0


@contextmanager
def real_postgres(url_from_env: str | None) -> Iterator[str]:
    """Yield the postgresql:// URL of a PostgreSQL that lives as long as the block."""
    if url_from_env:
        yield url_from_env
        return
    if docker_is_reachable():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer(POSTGRES_IMAGE, driver=None) as container:
            yield container.get_connection_url()
        return
    # Not under pytest's temporary folders: those are private to root, and the embedded server runs as
    # its own system user when the tests run as root.
    scratch = Path(tempfile.mkdtemp(prefix="loraplex-test-pg-"))
    scratch.chmod(0o755)
    server = EmbeddedPostgres(scratch / "pgdata")
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def truncate_all(url: str) -> None:
    """Empty every table of the schema (cheap enough to run before each test)."""

    async def run() -> None:
        connection = await _connect(url)
        try:
            await connection.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")
        finally:
            await connection.close()

    asyncio.run(run())


async def _connect(url: str) -> asyncpg.Connection:
    return await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
