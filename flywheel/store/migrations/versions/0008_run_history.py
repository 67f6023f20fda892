"""a run's history rows (per-step metrics) in the store; history.jsonl is their export

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26 15:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "run_history",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("project", sa.String(length=256), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("split", sa.String(length=64), nullable=True),
        sa.Column("time", sa.Float(), nullable=True),
        sa.Column("row", sa.Text(), nullable=False),
        sa.Column("branch", sa.String(length=256), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_run_history_run", "run_history", ["project", "model", "branch", "step"])


def downgrade() -> None:
    op.drop_index("ix_run_history_run", table_name="run_history")
    op.drop_table("run_history")
