"""per-key limits (they narrow the tenant's) and a fair-share weight per tenant for the engine's scheduler

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

WEIGHT_CHECK = "tenants_fair_share_weight_check"


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("rpm_limit", sa.Integer(), nullable=True))
    op.add_column("api_keys", sa.Column("tpm_limit", sa.Integer(), nullable=True))
    op.add_column("api_keys", sa.Column("max_concurrent", sa.Integer(), nullable=True))
    op.add_column("api_keys", sa.Column("monthly_token_budget", sa.BigInteger(), nullable=True))
    op.add_column("tenants", sa.Column("fair_share_weight", sa.Float(), server_default=sa.text("1.0"), nullable=False))
    op.create_check_constraint(WEIGHT_CHECK, "tenants", "fair_share_weight > 0")


def downgrade() -> None:
    op.drop_constraint(WEIGHT_CHECK, "tenants", type_="check")
    op.drop_column("tenants", "fair_share_weight")
    for column in ("monthly_token_budget", "max_concurrent", "tpm_limit", "rpm_limit"):
        op.drop_column("api_keys", column)
