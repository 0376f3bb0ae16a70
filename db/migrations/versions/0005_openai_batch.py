"""OpenAI Batch parity: job metadata, completion window and served model name; per-line model, the
choice index of an `n` > 1 line, and per-token logprobs of a result

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from specq.db.types import UTCDateTime

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("user_metadata", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("completion_window", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("expires_at", UTCDateTime(), nullable=True))
        batch.add_column(sa.Column("served_model_name", sa.Text(), nullable=True))
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("model", sa.Text(), nullable=True))
        batch.add_column(sa.Column("choice_index", sa.Integer(), server_default=sa.text("0"), nullable=False))
    with op.batch_alter_table("results") as batch:
        batch.add_column(sa.Column("logprobs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("results") as batch:
        batch.drop_column("logprobs")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("choice_index")
        batch.drop_column("model")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("served_model_name")
        batch.drop_column("expires_at")
        batch.drop_column("completion_window")
        batch.drop_column("user_metadata")
