"""OpenAI's fine-tuning API served locally: uploaded files, jobs, their events and checkpoints

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28 08:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "ft_files",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("lines", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "ft_jobs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("base_model", sa.String(length=256), nullable=False),
        sa.Column("method", sa.JSON(), nullable=False),
        sa.Column("training_file", sa.String(length=64), nullable=False),
        sa.Column("validation_file", sa.String(length=64), nullable=True),
        sa.Column("suffix", sa.String(length=64), nullable=True),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("meta", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("fine_tuned_model", sa.String(length=256), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("trained_tokens", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("seq"),
    )
    op.create_index("ix_ft_jobs_status", "ft_jobs", ["status"])
    op.create_table(
        "ft_job_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("level", sa.String(length=8), nullable=False),
        sa.Column("type", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["ft_jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_ft_job_events_job_id", "ft_job_events", ["job_id"])
    op.create_table(
        "ft_checkpoints",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=300), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["ft_jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "step", name="uq_ft_checkpoints_job_step"),
    )
    op.create_index("ix_ft_checkpoints_job_id", "ft_checkpoints", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_ft_checkpoints_job_id", table_name="ft_checkpoints")
    op.drop_table("ft_checkpoints")
    op.drop_index("ix_ft_job_events_job_id", table_name="ft_job_events")
    op.drop_table("ft_job_events")
    op.drop_index("ix_ft_jobs_status", table_name="ft_jobs")
    op.drop_table("ft_jobs")
    op.drop_table("ft_files")
