"""stored responses of /v1/responses (``store: true``): the response and the items it was generated from

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", UUID(as_uuid=True), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("previous_response_id", sa.String(64), nullable=True),
        sa.Column("input_items", JSONB(), nullable=False),
        sa.Column("response", JSONB(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("stored_responses_tenant", "stored_responses", ["tenant_id"])
    op.create_index("stored_responses_expires_at", "stored_responses", ["expires_at"])


def downgrade() -> None:
    op.drop_table("stored_responses")
