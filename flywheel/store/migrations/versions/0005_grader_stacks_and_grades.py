"""grader stack versions and the grades they gave

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26 09:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "grader_stacks",
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("version"),
    )
    op.create_index("ix_grader_stacks_name", "grader_stacks", ["name"])
    op.create_table(
        "grades",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("episode_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("component", sa.String(length=300), nullable=False),
        sa.Column("grader", sa.String(length=256), nullable=False),
        sa.Column("score", sa.Float(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["episode_id"], ["episodes.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["version"], ["grader_stacks.version"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("episode_id", "version", "component", name="uq_grades_episode_version_component"),
    )
    op.create_index("ix_grades_version", "grades", ["version"])


def downgrade() -> None:
    op.drop_index("ix_grades_version", table_name="grades")
    op.drop_table("grades")
    op.drop_index("ix_grader_stacks_name", table_name="grader_stacks")
    op.drop_table("grader_stacks")
