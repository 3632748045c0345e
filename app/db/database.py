"""The connection to PostgreSQL: one async SQLAlchemy engine and its session factory."""

from __future__ import annotations

import logging
import uuid

import asyncpg
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

logger = logging.getLogger(__name__)

POOL_SIZE = 10  # connections kept open; the request path reads through caches, so few are needed
PING_TIMEOUT_S = 2.0  # /ready answers within this even when the database hangs
CONNECT_TIMEOUT_S = 5.0  # a database host that drops packets fails a query in seconds, not asyncpg's 60
REPLICA_ID = "replica_id"
"""``Session.info`` key of every session a :class:`Database` opens: that Database's ``replica_id``."""


def async_url(url: str) -> str:
    """The SQLAlchemy URL for asyncpg, from a plain ``postgresql://`` (or ``postgres://``) URL."""
    for scheme in ("postgresql+asyncpg://", "postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+asyncpg://" + url[len(scheme) :]
    raise ValueError(f"not a PostgreSQL URL: {url!r}; expected postgresql://user:password@host/database")


def driver_url(url: str) -> str:
    """The URL as asyncpg itself reads it (``postgresql://``), from any form ``async_url`` accepts."""
    return "postgresql://" + async_url(url)[len("postgresql+asyncpg://") :]


class Database:
    """The app's handle on PostgreSQL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.replica_id = uuid.uuid4()
        """Names this process's gateway (one Database each) in what it announces to the others."""
        self.engine: AsyncEngine = create_async_engine(
            async_url(url), pool_size=POOL_SIZE, pool_pre_ping=True, connect_args={"timeout": CONNECT_TIMEOUT_S}
        )
        self.sessions: async_sessionmaker[AsyncSession] = async_sessionmaker(
            self.engine, expire_on_commit=False, info={REPLICA_ID: self.replica_id}
        )

    async def ping(self) -> bool:
        """True when a query gets an answer within PING_TIMEOUT_S."""
        try:
            async with self.engine.connect() as connection:
                await connection.execute(text("SELECT 1"), execution_options={"timeout": PING_TIMEOUT_S})
        except (SQLAlchemyError, OSError, TimeoutError) as error:
            logger.warning("database ping failed: %s", error)
            return False
        return True

    async def connect_driver(self) -> asyncpg.Connection:
        """A connection of asyncpg's own, outside the pool, for a task that keeps one open (the usage writer)."""
        return await asyncpg.connect(driver_url(self.url), timeout=CONNECT_TIMEOUT_S)

    async def close(self) -> None:
        await self.engine.dispose()
