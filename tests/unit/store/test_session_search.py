"""Session search on SQLite and PostgreSQL: every filter of the SDK's SessionSearchRequest, one owner's
sessions only, newest first, keyset pages that neither skip nor repeat sessions created at the same instant."""

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from server.store.rows import SessionRow
from server.store.store import CheckpointRecord, SessionQuery, Store, TrainingRunRecord

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def make_session(store: Store, session_id: str, minute: int, *, owner: str = "alice", display_name: str | None = None,
                 metadata: dict | None = None, project: str | None = None, finish: str | None = None) -> None:
    store.create_session(session_id, tags=[], user_metadata=metadata or {}, sdk_version=None,
                         display_name=display_name, owner=owner)
    if project is not None:
        store.set_session_project(session_id, project)
    if finish is not None:
        store.finish_session(session_id, finish)
    with store.engine.begin() as connection:  # creation times the test controls, ties included
        connection.execute(sa.update(SessionRow).where(SessionRow.session_id == session_id)
                           .values(created_at=T0 + timedelta(minutes=minute)))


def found(store: Store, **query) -> list[str]:
    return [hit.session.session_id for hit in store.search_sessions(SessionQuery(owner="alice", **query))]


@pytest.fixture
def sessions(store: Store) -> Store:
    make_session(store, "a", 1, display_name="Nightly SFT run", metadata={"team": "vision", "seed": "1"})
    make_session(store, "b", 2, display_name="nightly RL", metadata={"team": "vision"}, project="p1",
                 finish="success")
    make_session(store, "c", 3, display_name="ad hoc", project="p2", finish="errored")
    make_session(store, "d", 4, finish="expired")
    make_session(store, "e", 5, owner="bob", display_name="nightly SFT")
    return store


def test_a_tenant_finds_only_its_own_sessions_newest_first(sessions):
    assert found(sessions) == ["d", "c", "b", "a"]
    assert [h.session.session_id for h in sessions.search_sessions(SessionQuery(owner="bob"))] == ["e"]


def test_display_name_words_each_match_anywhere_ignoring_case_and_like_wildcards(sessions):
    assert found(sessions, display_name_words=("NIGHTLY",)) == ["b", "a"]
    assert found(sessions, display_name_words=("run", "nightly")) == ["a"]
    assert found(sessions, display_name_words=("%",)) == []
    assert found(sessions, session_id="c") == ["c"]
    assert found(sessions, session_id="c", display_name_words=("sft",)) == ["c", "a"]


def test_projects_metadata_and_statuses_filter(sessions):
    assert found(sessions, project_ids=("p1", "p2")) == ["c", "b"]
    assert found(sessions, project_ids=("default",)) == ["d", "a"]
    assert found(sessions, user_metadata={"team": "vision"}) == ["b", "a"]
    assert found(sessions, user_metadata={"team": "vision", "seed": "1"}) == ["a"]
    assert found(sessions, user_metadata={"team": "nlp"}) == []
    assert found(sessions, statuses=("active",)) == ["a"]
    assert found(sessions, statuses=("success", "errored")) == ["c", "b"]
    assert found(sessions, statuses=("active", "errored")) == ["c", "a"]
    assert found(sessions, statuses=()) == []


def test_pages_follow_the_cursor_through_sessions_created_at_the_same_instant(store):
    for session_id in ("s1", "s2", "s3", "s4", "s5"):
        make_session(store, session_id, 7)
    make_session(store, "s0", 6)
    pages, after = [], None
    while True:
        page = store.search_sessions(SessionQuery(owner="alice", after=after, limit=2))
        if not page:
            break
        pages.append([hit.session.session_id for hit in page])
        after = (page[-1].session.created_at, page[-1].session.session_id)
    assert pages == [["s5", "s4"], ["s3", "s2"], ["s1", "s0"]]


def test_each_hit_counts_the_checkpoints_of_its_runs(sessions):
    for model_seq_id in (0, 1):
        sessions.create_training_run(TrainingRunRecord(
            model_id=f"a:train:{model_seq_id}", session_id="a", owner="alice", base_model="m",
            model_seq_id=model_seq_id, lora_rank=8, seed=None, train_mlp=True, train_attn=True, train_unembed=True))
        for name, size in (("x", 100), ("y", None)):
            sessions.add_checkpoint(CheckpointRecord(
                tinker_path=f"tinker://a:train:{model_seq_id}/weights/{name}", model_id=f"a:train:{model_seq_id}",
                checkpoint_id=f"weights/{name}", checkpoint_type="training", directory="/x", size_bytes=size,
                owner="alice"))
    hits = {hit.session.session_id: hit for hit in sessions.search_sessions(SessionQuery(owner="alice"))}
    assert (hits["a"].num_checkpoints, hits["a"].checkpoint_bytes) == (4, 200)
    assert (hits["b"].num_checkpoints, hits["b"].checkpoint_bytes) == (0, 0)
    assert hits["b"].session.project_id == "p1" and hits["a"].session.project_id == "default"


def test_training_runs_list_by_project(sessions):
    for session_id in ("a", "b"):
        sessions.create_training_run(TrainingRunRecord(
            model_id=f"{session_id}:train:0", session_id=session_id, owner="alice", base_model="m", model_seq_id=0,
            lora_rank=8, seed=None, train_mlp=True, train_attn=True, train_unembed=True))
    runs, total = sessions.list_training_runs(owner="alice", limit=10, offset=0, project_id="p1")
    assert [run.model_id for run in runs] == ["b:train:0"] and total == 1
    assert sessions.list_training_runs(owner="alice", limit=10, offset=0)[1] == 2
