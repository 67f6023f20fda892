"""calls answered by an upstream, and text-only calls

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26 07:15:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("upstream", sa.String(length=256), nullable=True))
        batch_op.add_column(sa.Column("text_only", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_column("text_only")
        batch_op.drop_column("upstream")
