"""A fine-tuning job's result files (its step metrics as OpenAI's step_metrics.csv) and estimated finish

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28 11:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("ft_jobs") as batch:
        batch.add_column(sa.Column("result_files", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("estimated_finish", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ft_jobs") as batch:
        batch.drop_column("estimated_finish")
        batch.drop_column("result_files")
