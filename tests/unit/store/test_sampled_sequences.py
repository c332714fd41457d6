"""Sequences recorded for stable_reinforce, on SQLite and PostgreSQL: tenant scope, the renewed day, the sweep."""

from datetime import timedelta

import numpy as np
import pytest
import sqlalchemy as sa

from server.store.sampled_sequences import RECORD_TTL, SampledSequenceRecord, SampledSequences
from server.store.rows import SampledSequenceRow
from server.store.store import Store


@pytest.fixture
def store(database_url: str):
    store = Store(database_url)
    yield store
    store.close()


def sequence(sequence_id: str, owner: str = "alice", session_id: str = "s1") -> SampledSequenceRecord:
    return SampledSequenceRecord(
        sequence_id=sequence_id, owner=owner, session_id=session_id, sampling_session_id=f"{session_id}:sample:0",
        adapter="checkpoint-abc", prompt_keys=np.array([5, 6, -1 - 2**59, -1 - 2**59, 7], dtype=np.int64),
        tokens=np.array([8, 9, 151645]), logprobs=np.array([-0.25, -1.5, -3.125], dtype=np.float32))


def test_recorded_sequences_come_back_exactly_for_their_owner_only(store: Store):
    store.sampled_sequences.record([sequence("a:seq:0:0"), sequence("a:seq:0:1"), sequence("b:seq:0:0", owner="bob")])

    found = store.sampled_sequences.use({"a:seq:0:0", "b:seq:0:0", "missing"}, owner="alice")

    assert set(found) == {"a:seq:0:0"}
    record = found["a:seq:0:0"]
    expected = sequence("a:seq:0:0")
    assert (record.owner, record.session_id, record.sampling_session_id, record.adapter) == (
        "alice", "s1", "s1:sample:0", "checkpoint-abc")
    np.testing.assert_array_equal(record.prompt_keys, expected.prompt_keys)
    np.testing.assert_array_equal(record.tokens, expected.tokens)
    assert record.logprobs.dtype == np.float32
    np.testing.assert_array_equal(record.logprobs, expected.logprobs)


def test_expired_sequences_are_not_found_and_the_sweep_deletes_only_them(store: Store):
    expired = SampledSequences(store.engine, ttl=timedelta(0))
    expired.record([sequence("old:seq:0:0")])
    store.sampled_sequences.record([sequence("new:seq:0:0")])

    assert set(store.sampled_sequences.use({"old:seq:0:0", "new:seq:0:0"}, owner="alice")) == {"new:seq:0:0"}
    assert store.sampled_sequences.delete_expired() == 1
    assert store.sampled_sequences.delete_expired() == 0
    assert set(store.sampled_sequences.use({"new:seq:0:0"}, owner="alice")) == {"new:seq:0:0"}


def test_every_use_restarts_the_day(store: Store):
    SampledSequences(store.engine, ttl=timedelta(hours=1)).record([sequence("a:seq:0:0")])
    store.sampled_sequences.use({"a:seq:0:0"}, owner="alice")
    with store.engine.connect() as connection:
        created_at, expires_at = connection.execute(
            sa.select(SampledSequenceRow.created_at, SampledSequenceRow.expires_at)).one()
    assert RECORD_TTL == timedelta(days=1)
    assert expires_at - created_at > RECORD_TTL - timedelta(minutes=1)
