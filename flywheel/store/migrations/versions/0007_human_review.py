"""the human review queue: sampled episodes and the labels reviewers gave them

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 15:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "reviews",
        sa.Column("episode_id", sa.String(length=64), nullable=False),
        sa.Column("sample_event", sa.Integer(), nullable=False),
        sa.Column("queued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("label", sa.Float(), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=True),
        sa.Column("note", sa.String(length=2000), nullable=True),
        sa.Column("labelled_by", sa.String(length=256), nullable=True),
        sa.Column("labelled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("label_event", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["episode_id"], ["episodes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("episode_id"),
    )
    op.create_index("ix_reviews_queued_at", "reviews", ["queued_at"])


def downgrade() -> None:
    op.drop_index("ix_reviews_queued_at", table_name="reviews")
    op.drop_table("reviews")
