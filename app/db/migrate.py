"""Applying the Alembic revisions in ``migrations/`` to a database."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
APPLIED = "applied_revisions"  # the attribute migrations/env.py lists each revision it applies in


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["database_url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> list[str]:
    """Bring the schema up to ``revision`` (blocking; run it off the event loop); the revisions applied, in order."""
    config = alembic_config(url)
    config.attributes[APPLIED] = []
    command.upgrade(config, revision)
    return config.attributes[APPLIED]
