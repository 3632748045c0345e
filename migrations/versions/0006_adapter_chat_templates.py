"""an adapter's own chat template and tool-call format

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27

Existing adapters get neither: they keep the base model's template and the server's format.
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("adapters", sa.Column("tool_call_format", sa.String(32), nullable=True))
    op.add_column("adapters", sa.Column("chat_template", sa.Text(), nullable=True))
    op.add_column("adapters", sa.Column("chat_template_sha256", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("adapters", "chat_template_sha256")
    op.drop_column("adapters", "chat_template")
    op.drop_column("adapters", "tool_call_format")
