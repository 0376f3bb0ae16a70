"""fleet recovery: requests.starts, jobs.enqueued_at

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from specq.db.types import UTCDateTime

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("enqueued_at", UTCDateTime(), nullable=True))
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("starts", sa.Integer(), server_default=sa.text("0"), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("starts")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("enqueued_at")
