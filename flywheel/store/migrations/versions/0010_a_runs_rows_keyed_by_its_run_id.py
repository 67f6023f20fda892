"""a run's history rows and trajectories keyed by its run id too (two machines training one model name into a shared
store are two runs); rows stored before keep run "" until their directory adopts them

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26 19:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = {  # table: (its index, the columns after project and model)
    "run_history": ("ix_run_history_run", ["branch", "step"]),
    "run_trajectories": ("ix_run_trajectories_run", ["branch", "split", "step"]),
}


def upgrade() -> None:
    for table, (index, columns) in INDEXES.items():
        op.add_column(table, sa.Column("run", sa.String(length=64), server_default="", nullable=False))
        op.drop_index(index, table_name=table)
        op.create_index(index, table, ["project", "model", "run", *columns])


def downgrade() -> None:
    for table, (index, columns) in INDEXES.items():
        op.drop_index(index, table_name=table)
        with op.batch_alter_table(table) as batch:
            batch.drop_column("run")
        op.create_index(index, table, ["project", "model", *columns])
