"""tenants may be deleted: status 'deleted' keeps the row for the usage that points at it

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

CONSTRAINT = "tenants_status_check"


def upgrade() -> None:
    op.drop_constraint(CONSTRAINT, "tenants", type_="check")
    op.create_check_constraint(CONSTRAINT, "tenants", "status IN ('active', 'disabled', 'deleted')")


def downgrade() -> None:
    # The narrower check cannot hold deleted tenants; they come back disabled (their keys stay revoked).
    op.execute("UPDATE tenants SET status = 'disabled' WHERE status = 'deleted'")
    op.drop_constraint(CONSTRAINT, "tenants", type_="check")
    op.create_check_constraint(CONSTRAINT, "tenants", "status IN ('active', 'disabled')")
