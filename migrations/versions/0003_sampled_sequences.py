"""Sampled sequences recorded for stable_reinforce (record_stability_info).

Revision ID: 0003
Revises: 0001
Create Date: 2026-11-23 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002_api_keys"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sampled_sequences",
        sa.Column("sequence_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("sampling_session_id", sa.String(), nullable=False),
        sa.Column("adapter", sa.String(), nullable=True),
        sa.Column("prompt_keys", sa.LargeBinary(), nullable=False),
        sa.Column("tokens", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sequence_id", name=op.f("pk_sampled_sequences")),
    )
    op.create_index(op.f("ix_sampled_sequences_expires_at"), "sampled_sequences", ["expires_at"])


def downgrade() -> None:
    op.drop_table("sampled_sequences")
