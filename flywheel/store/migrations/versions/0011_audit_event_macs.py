"""an audit event's MAC: HMAC-SHA256 over its hash with a key kept outside the database (store/audit.py); events
stored before have none (the first signed event after them vouches for them, its hash chaining over theirs)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27 18:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("audit_events", sa.Column("mac", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("audit_events") as batch:
        batch.drop_column("mac")
