"""API keys issued to tenants (hashes only); futures get an owner and 64-bit seq_ids.

Rows written before this revision keep their owner: the digest of the key that created them
("tenant-<hex>"). A key issued with `python -m server keys create --tenant tenant-<hex>` reaches them.

Revision ID: 0002_api_keys
Revises: 0001
Create Date: 2026-12-02 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_api_keys"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(), nullable=False),
        sa.Column("key_hash", sa.String(), nullable=False),
        sa.Column("tenant", sa.String(), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("label", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant"), "api_keys", ["tenant"])
    with op.batch_alter_table("futures") as batch:
        batch.alter_column("seq_id", existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=True)
        batch.add_column(sa.Column("owner", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("futures") as batch:
        batch.drop_column("owner")
        batch.alter_column("seq_id", existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=True)
    op.drop_index(op.f("ix_api_keys_tenant"), table_name="api_keys")
    op.drop_table("api_keys")
