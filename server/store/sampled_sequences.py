"""Sequences sampled with record_stability_info: kept one day after their last use, for stable_reinforce.

Each row holds what one sampling request's prompt was (token ids, and image keys at image
positions), what one of its sequences sampled, the sampler's logprobs and the adapter version.
Lookups are scoped to the tenant; every training use restarts the day, and `delete_expired`
(run by the server's retention loop) keeps the table bounded. Knows nothing about spans or losses.
"""

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import numpy as np
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from server.store.rows import SampledSequenceRow

RECORD_TTL = timedelta(days=1)
"""Tinker's rule: a recorded sequence can be trained on for one day after sampling or its last use."""


@dataclass(frozen=True, slots=True)
class SampledSequenceRecord:
    """One recorded sequence (arrays as numpy, widened to int64 and float32)."""

    sequence_id: str
    owner: str
    session_id: str
    sampling_session_id: str
    adapter: str | None
    prompt_keys: np.ndarray
    """int64 per prompt position (expanded view): the token id, or the image's key at its positions."""
    tokens: np.ndarray
    """int64 sampled token ids."""
    logprobs: np.ndarray
    """float32 sampler logprob of each sampled token."""


class SampledSequences:
    """Queries over the sampled_sequences table; shares the Store's engine."""

    def __init__(self, engine: sa.Engine, ttl: timedelta = RECORD_TTL):
        self._transaction = sessionmaker(engine, expire_on_commit=False).begin
        self.ttl = ttl

    def record(self, records: list[SampledSequenceRecord]) -> None:
        """Keep a sampling request's sequences for `ttl` from now."""
        now = datetime.now(UTC)
        rows = [SampledSequenceRow(
            sequence_id=r.sequence_id, owner=r.owner, session_id=r.session_id,
            sampling_session_id=r.sampling_session_id, adapter=r.adapter,
            prompt_keys=np.asarray(r.prompt_keys, dtype="<i8").tobytes(),
            tokens=np.asarray(r.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(r.logprobs, dtype="<f4").tobytes(),
            created_at=now, expires_at=now + self.ttl) for r in records]
        with self._transaction() as db:
            db.add_all(rows)

    def use(self, sequence_ids: set[str], owner: str) -> dict[str, SampledSequenceRecord]:
        """The owner's unexpired sequences among `sequence_ids`, each given another `ttl` from now."""
        now = datetime.now(UTC)
        where = (SampledSequenceRow.sequence_id.in_(sorted(sequence_ids)), SampledSequenceRow.owner == owner,
                 SampledSequenceRow.expires_at > now)
        with self._transaction() as db:
            rows = list(db.scalars(sa.select(SampledSequenceRow).where(*where)))
            if rows:
                db.execute(sa.update(SampledSequenceRow)
                           .where(SampledSequenceRow.sequence_id.in_([row.sequence_id for row in rows]))
                           .values(expires_at=now + self.ttl))
            return {row.sequence_id: _to_record(row) for row in rows}

    def delete_expired(self) -> int:
        """Forget every sequence past its expiry; returns how many."""
        statement = sa.delete(SampledSequenceRow).where(SampledSequenceRow.expires_at <= datetime.now(UTC))
        with self._transaction() as db:
            return db.execute(statement).rowcount


def _to_record(row: SampledSequenceRow) -> SampledSequenceRecord:
    return SampledSequenceRecord(
        sequence_id=row.sequence_id, owner=row.owner, session_id=row.session_id,
        sampling_session_id=row.sampling_session_id, adapter=row.adapter,
        prompt_keys=np.frombuffer(row.prompt_keys, dtype="<i8").astype(np.int64),
        tokens=np.frombuffer(row.tokens, dtype="<i4").astype(np.int64),
        logprobs=np.frombuffer(row.logprobs, dtype="<f4").astype(np.float32))
