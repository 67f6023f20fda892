"""a run's saved trajectories in the store; trajectories/<split>/<step>.jsonl are their export

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26 16:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "run_trajectories",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("project", sa.String(length=256), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("split", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("trajectory", sa.Text(), nullable=False),
        sa.Column("branch", sa.String(length=256), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_run_trajectories_run", "run_trajectories", ["project", "model", "branch", "split", "step"])


def downgrade() -> None:
    op.drop_index("ix_run_trajectories_run", table_name="run_trajectories")
    op.drop_table("run_trajectories")
