"""Sessions belong to a project (a label within a tenant): session search and copy_weights name it.

Revision ID: 0004
Revises: 0001
Create Date: 2026-11-29 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("project_id", sa.String(), server_default="default", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.drop_column("project_id")
