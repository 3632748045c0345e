"""the tenant of the key that made each audited change

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04

Rows written before get the tenant of their actor_key_id's key.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("audit_log", sa.Column("actor_tenant_id", UUID(as_uuid=True), nullable=True))
    op.execute(
        "UPDATE audit_log SET actor_tenant_id = api_keys.tenant_id FROM api_keys "
        "WHERE api_keys.id = audit_log.actor_key_id"
    )


def downgrade() -> None:
    op.drop_column("audit_log", "actor_tenant_id")
