"""outcome feedback that arrives after an episode

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26 09:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "feedback",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("episode_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("note", sa.String(length=2000), nullable=True),
        sa.Column("source", sa.String(length=256), nullable=True),
        sa.Column("key", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["episode_id"], ["episodes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("episode_id", "key", name="uq_feedback_episode_key"),
    )
    op.create_index("ix_feedback_episode_id", "feedback", ["episode_id"])


def downgrade() -> None:
    op.drop_index("ix_feedback_episode_id", table_name="feedback")
    op.drop_table("feedback")
