"""Initial schema: sessions, training runs, sampling sessions, checkpoints and the futures journal.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 14:12:39
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("sdk_version", sa.String(), nullable=True),
        sa.Column("display_name", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finish_reason", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_sessions")),
    )
    op.create_index(op.f("ix_sessions_owner_created_at"), "sessions", ["owner", "created_at"])

    op.create_table(
        "training_runs",
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("model_seq_id", sa.Integer(), nullable=False),
        sa.Column("lora_rank", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("train_mlp", sa.Boolean(), nullable=False),
        sa.Column("train_attn", sa.Boolean(), nullable=False),
        sa.Column("train_unembed", sa.Boolean(), nullable=False),
        sa.Column("optimizer_type", sa.String(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_request_time", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.session_id"], name=op.f("fk_training_runs_session_id_sessions")
        ),
        sa.PrimaryKeyConstraint("model_id", name=op.f("pk_training_runs")),
    )
    op.create_index(op.f("ix_training_runs_owner_created_at"), "training_runs", ["owner", "created_at"])
    op.create_index(op.f("ix_training_runs_session_id"), "training_runs", ["session_id"])

    op.create_table(
        "sampling_sessions",
        sa.Column("sampling_session_id", sa.String(), nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("model_path", sa.String(), nullable=True),
        sa.Column("source_model_id", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.session_id"], name=op.f("fk_sampling_sessions_session_id_sessions")
        ),
        sa.PrimaryKeyConstraint("sampling_session_id", name=op.f("pk_sampling_sessions")),
    )
    op.create_index(op.f("ix_sampling_sessions_session_id"), "sampling_sessions", ["session_id"])

    op.create_table(
        "checkpoints",
        sa.Column("tinker_path", sa.String(), nullable=False),
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("checkpoint_id", sa.String(), nullable=False),
        sa.Column("checkpoint_type", sa.String(), nullable=False),
        sa.Column("directory", sa.String(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("public", sa.Boolean(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["model_id"], ["training_runs.model_id"], name=op.f("fk_checkpoints_model_id_training_runs")
        ),
        sa.PrimaryKeyConstraint("tinker_path", name=op.f("pk_checkpoints")),
    )
    op.create_index(op.f("ix_checkpoints_model_id_created_at"), "checkpoints", ["model_id", "created_at"])
    op.create_index(op.f("ix_checkpoints_owner_created_at"), "checkpoints", ["owner", "created_at"])

    op.create_table(
        "futures",
        sa.Column("request_id", sa.String(), nullable=False),
        sa.Column("request_type", sa.String(), nullable=False),
        sa.Column("model_id", sa.String(), nullable=True),
        sa.Column("seq_id", sa.Integer(), nullable=True),
        sa.Column("payload_hash", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.Column("content_type", sa.String(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("error_category", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_futures")),
        sa.UniqueConstraint("model_id", "seq_id", name=op.f("uq_futures_model_id_seq_id")),
    )
    op.create_index(op.f("ix_futures_status_finished_at"), "futures", ["status", "finished_at"])


def downgrade() -> None:
    op.drop_table("futures")
    op.drop_table("checkpoints")
    op.drop_table("sampling_sessions")
    op.drop_table("training_runs")
    op.drop_table("sessions")
