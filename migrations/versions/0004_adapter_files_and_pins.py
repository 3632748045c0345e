"""adapter files in PostgreSQL by digest (the data folder becomes a cache) and admin pins in the adapters table

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25

The data step reads each stored adapter's two files from its ``storage_path`` folder and inserts them;
a row whose folder is missing or unreadable is logged and left (its adapter then answers errors until it
is uploaded again), so an upgrade never fails on a lost cache folder.
"""

import logging
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

logger = logging.getLogger("alembic.runtime.migration")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def upgrade() -> None:
    op.create_table(
        "adapter_files",
        sa.Column("digest", sa.String(64), primary_key=True),
        sa.Column("config", sa.LargeBinary(), nullable=False),
        sa.Column("weights", sa.LargeBinary(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )
    op.add_column("adapters", sa.Column("pinned", sa.Boolean(), server_default=sa.false(), nullable=False))
    _move_stored_adapters_in()


def _move_stored_adapters_in() -> None:
    """Insert the files of every stored digest, one at a time (adapters are megabytes each)."""
    connection = op.get_bind()
    rows = connection.execute(sa.text("SELECT DISTINCT ON (digest) digest, storage_path FROM adapters ORDER BY digest"))
    insert = sa.text(
        "INSERT INTO adapter_files (digest, config, weights, size_bytes) VALUES (:digest, :config, :weights, :size) "
        "ON CONFLICT (digest) DO NOTHING"
    )
    moved = 0
    for digest, storage_path in rows.all():
        folder = Path(storage_path)
        try:
            config = (folder / CONFIG_FILE).read_bytes()
            weights = (folder / WEIGHTS_FILE).read_bytes()
        except OSError as error:
            logger.warning("adapter %s: its folder %s could not be read (%s); left out", digest[:12], folder, error)
            continue
        size = len(config) + len(weights)
        connection.execute(insert, {"digest": digest, "config": config, "weights": weights, "size": size})
        moved += 1
    logger.info("moved %d stored adapter(s) into adapter_files", moved)


def downgrade() -> None:
    op.drop_column("adapters", "pinned")
    op.drop_table("adapter_files")
