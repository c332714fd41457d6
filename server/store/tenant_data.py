"""What a tenant keeps in the journal beyond its checkpoint files: how many bytes (its storage quota counts
them, so that no key holder fills the disk through sessions, runs or results), and deleting a session with
everything recorded under it.

Knows the tables only; which tenant may delete what, and when, is the route's business.
"""

import sqlalchemy as sa

from server.store.rows import (FutureRow, RunMetricRow, SampledSequenceRow, SamplingSessionRow, SessionRow,
                               TrainingRunRow)

JOURNAL_ROW_BYTES = 256
"""What a row costs beyond its free text and blobs (keys, timestamps, index entries), roughly."""


def _text_bytes(column) -> sa.ColumnElement[int]:
    return sa.func.coalesce(sa.func.sum(sa.func.length(sa.cast(column, sa.Text))), 0)


def _blob_bytes(*columns) -> sa.ColumnElement[int]:
    return sa.func.coalesce(sa.func.sum(sum(sa.func.coalesce(sa.func.length(c), 0) for c in columns)), 0)


class TenantData:
    """Journal bytes per tenant, and session deletion."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine

    def journal_bytes(self, owner: str) -> int:
        """Bytes the owner's rows take in the journal: sessions, runs, samplers, futures, recorded samples."""
        overhead = sa.func.count() * JOURNAL_ROW_BYTES
        statements = [
            sa.select(overhead + _text_bytes(SessionRow.display_name) + _text_bytes(SessionRow.user_metadata)
                      + _text_bytes(SessionRow.tags) + _text_bytes(SessionRow.sdk_version)
                      ).where(SessionRow.owner == owner),
            sa.select(overhead + _text_bytes(TrainingRunRow.user_metadata)).where(TrainingRunRow.owner == owner),
            sa.select(overhead).where(SamplingSessionRow.owner == owner),
            sa.select(overhead + _blob_bytes(FutureRow.result, FutureRow.error)).where(FutureRow.owner == owner),
            sa.select(overhead + _blob_bytes(SampledSequenceRow.prompt_keys, SampledSequenceRow.tokens,
                                             SampledSequenceRow.logprobs)).where(SampledSequenceRow.owner == owner),
        ]
        with self.engine.connect() as connection:
            return sum(int(connection.scalar(statement)) for statement in statements)

    def delete_session(self, session_id: str) -> None:
        """Delete a session and what hangs off it: its runs (with their results and curves), its samplers and
        the samples they recorded. The caller made sure that no checkpoint and no request of it remains."""
        runs = sa.select(TrainingRunRow.model_id).where(TrainingRunRow.session_id == session_id)
        samplers = sa.select(SamplingSessionRow.sampling_session_id).where(
            SamplingSessionRow.session_id == session_id)
        with self.engine.begin() as connection:
            connection.execute(sa.delete(FutureRow).where(FutureRow.model_id.in_(runs)
                                                          | FutureRow.model_id.in_(samplers)))
            connection.execute(sa.delete(RunMetricRow).where(RunMetricRow.model_id.in_(runs)))
            connection.execute(sa.delete(SampledSequenceRow).where(SampledSequenceRow.session_id == session_id))
            connection.execute(sa.delete(SamplingSessionRow).where(SamplingSessionRow.session_id == session_id))
            connection.execute(sa.delete(TrainingRunRow).where(TrainingRunRow.session_id == session_id))
            connection.execute(sa.delete(SessionRow).where(SessionRow.session_id == session_id))
