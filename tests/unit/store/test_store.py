"""Store tests, each run on SQLite and on PostgreSQL (see the database_url fixture)."""

import sqlite3
import threading
from contextlib import closing
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from server.store.db import MIGRATIONS_DIR
from server.store.rows import Base
from server.store.store import CheckpointRecord, SamplingSessionRecord, Store, TrainingRunRecord, _Remembered

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def make_session(store: Store, session_id: str = "s1", owner: str = "alice") -> None:
    store.create_session(
        session_id, tags=["vlm"], user_metadata={"k": "v"}, sdk_version="0.38.0", display_name=None, owner=owner
    )


def make_run(session_id: str = "s1", model_seq_id: int = 0, owner: str = "alice", **overrides) -> TrainingRunRecord:
    values = dict(
        model_id=f"{session_id}:train:{model_seq_id}",
        session_id=session_id,
        owner=owner,
        base_model="builtin:tiny-qwen2-vl",
        model_seq_id=model_seq_id,
        lora_rank=8,
        seed=2**40,
        train_mlp=True,
        train_attn=True,
        train_unembed=False,
        user_metadata={"run": str(model_seq_id)},
    )
    return TrainingRunRecord(**{**values, **overrides})


def insert_future(store: Store, request_id: str, model_id: str | None = None, seq_id: int | None = None, **overrides):
    values = {"request_type": "forward_backward", "payload_hash": "h", **overrides}
    return store.insert_future(request_id=request_id, model_id=model_id, seq_id=seq_id, **values)


def make_checkpoint(name: str, created_at: datetime, model_id: str = "s1:train:0", owner: str = "alice"):
    return CheckpointRecord(
        tinker_path=f"tinker://{model_id}/weights/{name}",
        model_id=model_id,
        checkpoint_id=f"weights/{name}",
        checkpoint_type="training",
        directory=f"/data/checkpoints/{name}",
        size_bytes=5 * 2**30,
        owner=owner,
        created_at=created_at,
    )


def test_a_session_heartbeats_until_it_finishes_once(store: Store):
    make_session(store)
    created = store.get_session("s1")
    assert created.tags == ["vlm"] and created.user_metadata == {"k": "v"} and created.sdk_version == "0.38.0"
    assert created.created_at.tzinfo == UTC and created.finished_at is None

    assert store.heartbeat_session("s1")
    assert store.get_session("s1").last_heartbeat_at > created.last_heartbeat_at
    assert store.finish_session("s1", "client closed")
    assert not store.finish_session("s1", "again")
    assert not store.heartbeat_session("s1")

    finished = store.get_session("s1")
    assert finished.finish_reason == "client closed" and finished.finished_at.tzinfo == UTC


def test_silent_sessions_are_the_unfinished_ones_without_a_recent_heartbeat(store: Store):
    for session_id in ["beating", "silent", "closed"]:
        make_session(store, session_id)
    store.finish_session("closed", "success")
    assert sorted(store.silent_session_ids(0)) == ["beating", "silent"]
    assert store.silent_session_ids(3600) == []


def test_unknown_sessions_are_none_and_cannot_heartbeat_or_finish(store: Store):
    assert store.get_session("nope") is None
    assert not store.heartbeat_session("nope")
    assert not store.finish_session("nope", "reason")


def test_sessions_are_listed_per_owner_newest_first(store: Store):
    for session_id in ["a", "b", "c"]:
        make_session(store, session_id)
    make_session(store, "bob-1", owner="bob")

    assert [s.session_id for s in store.list_sessions(owner="alice", limit=10, offset=0)] == ["c", "b", "a"]
    assert [s.session_id for s in store.list_sessions(owner="alice", limit=1, offset=1)] == ["b"]
    assert [s.session_id for s in store.list_sessions(owner="bob", limit=10, offset=0)] == ["bob-1"]


def test_a_session_lists_its_training_runs_and_sampling_sessions(store: Store):
    make_session(store)
    store.create_training_run(make_run(model_seq_id=1))
    store.create_training_run(make_run(model_seq_id=0))
    store.create_sampling_session(
        SamplingSessionRecord(
            sampling_session_id="s1:sample:0", session_id="s1", owner="alice", base_model="m", model_path=None
        )
    )

    assert store.list_training_run_ids("s1") == ["s1:train:0", "s1:train:1"]
    assert store.list_sampling_session_ids("s1") == ["s1:sample:0"]
    assert store.get_sampling_session("s1:sample:0").model_path is None
    assert store.get_sampling_session("s1:sample:9") is None


def test_a_training_run_round_trips_every_field(store: Store):
    make_session(store)
    run = make_run(optimizer_type="adamw", created_at=T0, last_request_time=T0 + timedelta(hours=1))
    store.create_training_run(run)
    assert store.get_training_run(run.model_id) == run
    assert store.get_training_run("s1:train:9") is None


def test_training_runs_are_listed_per_owner_newest_first_with_total_count(store: Store):
    make_session(store)
    make_session(store, "s2", owner="bob")
    for seq in range(5):
        store.create_training_run(make_run(model_seq_id=seq, created_at=T0 + timedelta(minutes=seq)))
    store.create_training_run(make_run("s2", owner="bob"))

    page, total = store.list_training_runs(owner="alice", limit=2, offset=1)
    assert [run.model_id for run in page] == ["s1:train:3", "s1:train:2"] and total == 5
    page, total = store.list_training_runs(owner="alice", limit=10, offset=4)
    assert [run.model_id for run in page] == ["s1:train:0"] and total == 5
    assert store.list_training_runs(owner="carol", limit=10, offset=0) == ([], 0)


def test_touching_a_training_run_moves_its_last_request_time(store: Store):
    make_session(store)
    store.create_training_run(make_run(last_request_time=T0))
    store.touch_training_run("s1:train:0")
    assert store.get_training_run("s1:train:0").last_request_time > T0


def test_a_training_run_needs_an_existing_session(store: Store):
    with pytest.raises(sa.exc.IntegrityError):
        store.create_training_run(make_run("missing"))


def test_json_columns_reject_values_of_the_wrong_type(store: Store):
    with pytest.raises(sa.exc.StatementError, match="validation error"):
        store.create_session("s1", tags=[], user_metadata={"k": 1}, sdk_version=None, display_name=None, owner="a")


def test_a_retried_seq_id_returns_the_original_future_unchanged(store: Store):
    first = insert_future(store, "r1", "s1:train:0", 1, payload_hash="h1")
    assert first.status == "pending" and first.request_id == "r1"

    retry = insert_future(store, "r2", "s1:train:0", 1, request_type="optim_step", payload_hash="h2")
    assert retry == first
    assert store.get_future("r2") is None


def test_sampling_seq_ids_are_keyed_apart_from_training_seq_ids(store: Store):
    train = insert_future(store, "r1", "s1:train:0", 1)
    sample = insert_future(store, "r2", "s1:sample:0", 1, request_type="sample")
    assert (train.request_id, sample.request_id) == ("r1", "r2")


def test_futures_without_a_seq_id_are_always_new(store: Store):
    futures = [insert_future(store, f"r{i}", request_type="create_model") for i in range(3)]
    assert [future.request_id for future in futures] == ["r0", "r1", "r2"]


def test_concurrent_inserts_of_one_seq_id_make_exactly_one_row(store: Store):
    num_threads = 8
    barrier = threading.Barrier(num_threads)
    results = [None] * num_threads

    def insert(i: int) -> None:
        barrier.wait()
        results[i] = insert_future(store, f"r{i}", "s1:train:0", 7)

    threads = [threading.Thread(target=insert, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len({future.request_id for future in results}) == 1
    assert [store.get_future(f"r{i}") is not None for i in range(num_threads)].count(True) == 1


def test_complete_and_fail_round_trip_and_keep_the_first_outcome(store: Store):
    for request_id in ["ok", "bad"]:
        insert_future(store, request_id, request_type="sample")
    payload = bytes(range(256)) * 1000

    store.complete_future("ok", result=payload, content_type="application/x-protobuf")
    store.fail_future("bad", error="Expected 4 tokens, got 6 from image", category="user")
    store.fail_future("ok", error="too late", category="server")

    ok = store.get_future("ok")
    assert (ok.status, ok.result, ok.content_type, ok.error) == ("complete", payload, "application/x-protobuf", None)
    assert ok.finished_at.tzinfo == UTC
    bad = store.get_future("bad")
    assert (bad.status, bad.result, bad.error_category) == ("failed", None, "user")
    assert bad.error == "Expected 4 tokens, got 6 from image"


def test_fail_pending_futures_fails_only_the_pending_ones(store: Store):
    for request_id in ["done", "p1", "p2"]:
        insert_future(store, request_id, request_type="sample")
    store.complete_future("done", result=b"x", content_type="application/json")

    assert store.fail_pending_futures("server restarted") == 2
    assert store.get_future("done").status == "complete"
    failed = store.get_future("p1")
    assert (failed.status, failed.error, failed.error_category) == ("failed", "server restarted", "server")
    assert store.fail_pending_futures("again") == 0


def test_retention_deletes_only_finished_futures_older_than_the_cutoff(store: Store):
    for request_id in ["done", "failed", "pending"]:
        insert_future(store, request_id, request_type="sample")
    store.complete_future("done", result=b"x", content_type="application/json")
    store.fail_future("failed", error="e", category="user")

    assert store.delete_finished_futures_older_than(3600) == 0
    assert store.delete_finished_futures_older_than(0) == 2
    assert store.get_future("done") is None and store.get_future("pending").status == "pending"


def test_checkpoints_list_newest_first_replace_by_path_and_delete(store: Store):
    make_session(store)
    make_session(store, "s2", owner="bob")
    store.create_training_run(make_run(model_seq_id=0))
    store.create_training_run(make_run(model_seq_id=1))
    store.create_training_run(make_run("s2", owner="bob"))
    for minute, name in enumerate(["a", "b", "c"]):
        store.add_checkpoint(make_checkpoint(name, T0 + timedelta(minutes=minute)))
    store.add_checkpoint(make_checkpoint("d", T0 + timedelta(minutes=9), model_id="s1:train:1"))
    store.add_checkpoint(make_checkpoint("e", T0, model_id="s2:train:0", owner="bob"))

    page, total = store.list_checkpoints(model_id="s1:train:0", owner="alice", limit=2, offset=0)
    assert [c.checkpoint_id for c in page] == ["weights/c", "weights/b"] and total == 3
    page, total = store.list_checkpoints(model_id=None, owner="alice", limit=10, offset=0)
    assert [c.checkpoint_id for c in page] == ["weights/d", "weights/c", "weights/b", "weights/a"] and total == 4

    replacement = make_checkpoint("a", T0 + timedelta(minutes=5))
    store.add_checkpoint(replacement)
    assert store.get_checkpoint(replacement.tinker_path) == replacement
    assert store.list_checkpoints(model_id="s1:train:0", owner="alice", limit=1, offset=0)[0][0] == replacement

    expires_at = T0 + timedelta(days=1)
    assert store.set_checkpoint_public(replacement.tinker_path, True)
    assert store.set_checkpoint_expires_at(replacement.tinker_path, expires_at)
    updated = store.get_checkpoint(replacement.tinker_path)
    assert updated.public and updated.expires_at == expires_at

    assert store.delete_checkpoint(replacement.tinker_path)
    assert not store.delete_checkpoint(replacement.tinker_path)
    assert store.get_checkpoint(replacement.tinker_path) is None
    assert not store.set_checkpoint_public(replacement.tinker_path, False)


def test_a_checkpoint_read_lately_is_remembered_until_a_write_to_its_row(store: Store):
    make_session(store)
    store.create_training_run(make_run())
    checkpoint = make_checkpoint("a", T0)
    store.add_checkpoint(checkpoint)
    path = checkpoint.tinker_path
    assert store.remembered_checkpoint(path) is None  # written, never read
    for change in [lambda: store.set_checkpoint_public(path, True),
                   lambda: store.set_checkpoint_expires_at(path, T0),
                   lambda: store.add_checkpoint(make_checkpoint("a", T0 + timedelta(minutes=1)))]:
        before = store.get_checkpoint(path)
        assert store.remembered_checkpoint(path) == before
        change()
        assert store.remembered_checkpoint(path) is None
        assert store.get_checkpoint(path) != before
    store.set_checkpoint_expires_at(path, T0)
    assert store.delete_expired_checkpoint(store.get_checkpoint(path), T0 + timedelta(days=1))
    assert store.remembered_checkpoint(path) is None and store.get_checkpoint(path) is None


def test_a_record_read_before_a_forget_is_not_remembered():
    remembered = _Remembered[str]()
    era = remembered.era()
    remembered.forget("other")  # a write lands while the read is under way: the read may be stale
    remembered.put("key", "stale", era)
    assert remembered.get("key") is None
    remembered.put("key", "fresh", remembered.era())
    assert remembered.get("key") == "fresh"


def test_a_restarted_store_sees_everything_and_reruns_no_migration(database_url: str):
    first = Store(database_url)
    make_session(first)
    first.create_training_run(make_run())
    insert_future(first, "r1", "s1:train:0", 1)
    first.close()

    second = Store(database_url)
    assert second.get_session("s1").owner == "alice"
    assert second.get_training_run("s1:train:0").lora_rank == 8
    assert second.get_future("r1").status == "pending"
    with second.engine.connect() as connection:
        current = MigrationContext.configure(connection).get_current_revision()
    assert current == ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
    second.close()


def test_the_migrated_schema_matches_the_row_declarations(store: Store):
    with store.engine.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert differences == []


def test_sqlite_runs_in_wal_mode_with_foreign_keys_and_a_busy_timeout(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/server.db")
    with store.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    store.close()
    # The journal mode is a property of the file, so a plain connection sees it too.
    with closing(sqlite3.connect(tmp_path / "server.db")) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_api_keys_are_stored_as_hashes_found_by_hash_and_refused_once_revoked(store: Store):
    from server.store.api_keys import hash_api_key, issue_api_key

    assert not store.has_api_keys()
    key, record = issue_api_key(store, "alice", label="laptop")
    admin_key, _ = issue_api_key(store, "ops", admin=True)
    assert key.startswith("tml-") and len(key) > 40 and key != admin_key
    with store.engine.connect() as connection:
        stored = [tuple(row) for row in connection.execute(sa.text("SELECT * FROM api_keys"))]
    assert not any(key in str(value) for row in stored for value in row)  # only the hash is kept
    assert store.find_api_key(hash_api_key(key)).tenant == "alice"
    assert store.find_api_key(hash_api_key(admin_key)).admin
    assert store.find_api_key(hash_api_key("tml-guess")) is None
    assert [k.tenant for k in store.list_api_keys()] == ["alice", "ops"]
    assert store.revoke_api_key(record.key_id) and not store.revoke_api_key(record.key_id)
    assert store.find_api_key(hash_api_key(key)) is None
    assert store.list_api_keys("alice")[0].revoked_at is not None and store.has_api_keys()
    with pytest.raises(ValueError, match="tenant name"):
        issue_api_key(store, "no spaces please")


def test_a_tenant_counts_its_runs_in_open_sessions_and_its_stored_checkpoint_bytes(store: Store):
    make_session(store, "s1")
    make_session(store, "s2")
    make_session(store, "s3", owner="bob")
    store.create_training_run(make_run("s1", 0))
    store.create_training_run(make_run("s2", 0))
    store.create_training_run(make_run("s3", 0, owner="bob"))
    assert store.count_active_training_runs("alice") == 2
    store.finish_session("s1", "success")
    assert store.count_active_training_runs("alice") == 1 and store.count_active_training_runs("bob") == 1
    store.add_checkpoint(make_checkpoint("a", T0, model_id="s1:train:0"))
    store.add_checkpoint(make_checkpoint("b", T0, model_id="s2:train:0"))
    assert store.stored_checkpoint_bytes("alice") == 2 * make_checkpoint("a", T0).size_bytes
    assert store.stored_checkpoint_bytes("bob") == 0


def test_a_tenants_journal_bytes_grow_with_its_rows_and_a_deleted_session_takes_everything_under_it(store: Store):
    usage = store.tenant_data
    assert usage.journal_bytes("alice") == 0
    store.create_session("s1", tags=["t"], user_metadata={"k": "v" * 5000}, sdk_version="0.38.0",
                         display_name="x" * 1000, owner="alice")
    session_bytes = usage.journal_bytes("alice")
    assert session_bytes > 6000
    make_session(store, "s2", owner="bob")
    store.create_training_run(make_run("s1", 0))
    store.create_training_run(make_run("s2", 0, owner="bob"))
    store.create_sampling_session(SamplingSessionRecord(sampling_session_id="s1:sample:0", session_id="s1",
                                                        owner="alice", base_model="b", model_path=None))
    insert_future(store, "f1", model_id="s1:train:0", seq_id=1, owner="alice")
    store.complete_future("f1", result=b"r" * 10_000, content_type="application/x-protobuf")
    insert_future(store, "f2", model_id="s1:sample:0", seq_id=1, owner="alice")
    insert_future(store, "f3", model_id="s2:train:0", seq_id=1, owner="bob")
    assert usage.journal_bytes("alice") > session_bytes + 10_000
    bob = usage.journal_bytes("bob")
    assert store.get_sampling_session("s1:sample:0") is not None  # now in the store's memory too

    store.delete_session("s1")

    assert usage.journal_bytes("alice") == 0 and usage.journal_bytes("bob") == bob
    assert store.get_session("s1") is None and store.get_training_run("s1:train:0") is None
    assert store.get_sampling_session("s1:sample:0") is None and store.get_future("f1") is None
    assert store.get_future("f3") is not None and store.get_training_run("s2:train:0") is not None


def test_seq_ids_past_32_bits_fit_the_journal(store: Store):
    # Sampling clones number their requests clone_id * 1e9 + k.
    record = insert_future(store, "clone", model_id="s:sample:0", seq_id=999_999_999 * 10**9 + 7, owner="alice")
    assert (record.seq_id, record.owner) == (999_999_999 * 10**9 + 7, "alice")
