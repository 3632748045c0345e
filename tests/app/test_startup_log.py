"""The start-up log of a fresh `loraplex serve`: the lines an operator acts on, and no library's chatter."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import make_url

from app.db.migrate import MIGRATIONS_DIR
from app.model_store import resolve_model
from app.observability.log_format import OWN_LOGGERS, configure_logging
from tests.app.served_process import served

# TEXT_FORMAT's lines: "12:00:00 INFO app.gateway [-]: database: ..."
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<level>[A-Z]+) (?P<logger>\S+) \[[^\]]*\]: (?P<message>.*)$")


def _admin(url: str, statement: str) -> None:
    async def run() -> None:
        connection = await asyncpg.connect(url)
        try:
            await connection.execute(statement)
        finally:
            await connection.close()

    asyncio.run(run())


@pytest.fixture
def fresh_database_url(postgres_url: str) -> Iterator[str]:
    """A new, empty database on the session's PostgreSQL, dropped afterwards."""
    name = f"fresh_{uuid.uuid4().hex[:12]}"
    _admin(postgres_url, f'CREATE DATABASE "{name}"')
    try:
        yield make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
    finally:
        _admin(postgres_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _is_own(logger_name: str) -> bool:
    return any(logger_name == own or logger_name.startswith(own + ".") for own in OWN_LOGGERS)


def test_fresh_start_logs_what_an_operator_needs_and_no_library_set_up(
    fresh_database_url: str, data_home: Path, tmp_path: Path
) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("LORAPLEX_", "DATABASE_URL"))}
    env |= {
        "LORAPLEX_HOME": str(tmp_path / "home"),
        "LORAPLEX_MODEL": str(resolve_model("default", data_home)),
        "DATABASE_URL": fresh_database_url,
        "LORAPLEX_DEMO": "0",  # the demo's training is not part of what this checks
        "LORAPLEX_KEY_SECRET": secrets.token_hex(32),
        "LORAPLEX_POOL_MB": "64",
    }
    log = tmp_path / "serve.log"
    with served(tmp_path, env, grace_s=5, log=log) as (_, url):
        pass
    text = log.read_text()
    records = [match.groupdict() for match in map(LOG_LINE.match, text.splitlines()) if match]
    assert records, text

    chatter = [r for r in records if r["level"] in ("DEBUG", "INFO") and not _is_own(r["logger"])]
    assert not chatter, "library lines at INFO:\n" + "\n".join(map(str, chatter))
    assert not [r for r in records if "plugin" in r["message"].lower() or r["logger"].startswith("alembic")], text

    messages = [r["message"] for r in records]
    num_migrations = len(list((MIGRATIONS_DIR / "versions").glob("[0-9]*.py")))
    assert sum(m.startswith("database: ") for m in messages) == 1, text
    assert [m for m in messages if "migration" in m] == [
        next(m for m in messages if m.startswith(f"database schema up to date: applied {num_migrations} migrations"))
    ], text
    assert any(m.startswith("engine ready: ") for m in messages), text
    assert any(re.match(r"engine worker process \d+ ready", m) for m in messages), text
    assert f"listening on {url}" in messages, text


@pytest.mark.parametrize(("level", "shown"), [("info", False), ("debug", True)])
def test_library_info_lines_only_at_debug(level: str, shown: bool, capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    handlers, root_level = root.handlers[:], root.level
    try:
        configure_logging(json_lines=False, level=level)
        logging.getLogger("alembic.runtime.plugins").info("setting up autogenerate plugin")
        logging.getLogger("alembic.runtime.migration").warning("a library's warning")
        logging.getLogger("app.gateway").info("an operator's line")
    finally:
        root.handlers[:] = handlers
        root.setLevel(root_level)
    err = capsys.readouterr().err
    assert ("setting up autogenerate plugin" in err) is shown
    assert "a library's warning" in err and "an operator's line" in err
