"""deployments and the audit trail (its events and the head row that serialises appends)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26 09:06:08.336570
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=256), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("subject", sa.String(length=300), nullable=False),
        sa.Column("reason", sa.String(length=2000), nullable=True),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("prev_hash", sa.String(length=64), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("audit_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_events_action"), ["action"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_events_subject"), ["subject"], unique=False)
    head = op.create_table(
        "audit_head",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.bulk_insert(head, [{"id": 1, "count": 0, "hash": "0" * 64}])  # the empty chain (audit.GENESIS)
    op.create_table(
        "deployments",
        sa.Column("name", sa.String(length=300), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("stage", sa.String(length=32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("share", sa.Float(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=256), nullable=False),
        sa.Column("event_id", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_deployments_model"), ["model"], unique=False)
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("deployment", sa.String(length=300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_column("deployment")
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_deployments_model"))
    op.drop_table("deployments")
    op.drop_table("audit_head")
    with op.batch_alter_table("audit_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_events_subject"))
        batch_op.drop_index(batch_op.f("ix_audit_events_action"))
    op.drop_table("audit_events")
