"""deployments' tool policies (scope, high-impact tools) and the approvals of high-impact tool calls

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28 14:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tool_policies",
        sa.Column("deployment", sa.String(length=300), nullable=False),
        sa.Column("allowed", sa.JSON(), nullable=True),
        sa.Column("high_impact", sa.JSON(), nullable=False),
        sa.Column("timeout_s", sa.Float(), nullable=False),
        sa.Column("otherwise", sa.String(length=16), nullable=False),
        sa.Column("grader", sa.JSON(), nullable=True),
        sa.Column("threshold", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=256), nullable=False),
        sa.Column("event_id", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("deployment"),
    )
    op.create_table(
        "approvals",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("deployment", sa.String(length=300), nullable=True),
        sa.Column("episode_id", sa.String(length=64), nullable=True),
        sa.Column("split", sa.String(length=32), nullable=True),
        sa.Column("tool", sa.String(length=256), nullable=False),
        sa.Column("arguments", sa.Text(), nullable=False),
        sa.Column("call_id", sa.String(length=256), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deadline", sa.DateTime(timezone=True), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("decided_by", sa.String(length=256), nullable=True),
        sa.Column("reason", sa.String(length=2000), nullable=True),
        sa.Column("request_event", sa.Integer(), nullable=False),
        sa.Column("decision_event", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_approvals_episode_id", "approvals", ["episode_id"])
    op.create_index("ix_approvals_status", "approvals", ["status"])


def downgrade() -> None:
    op.drop_index("ix_approvals_status", table_name="approvals")
    op.drop_index("ix_approvals_episode_id", table_name="approvals")
    op.drop_table("approvals")
    op.drop_table("tool_policies")
