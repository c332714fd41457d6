"""The TTL sweeper on SQLite and PostgreSQL: expired checkpoints lose their rows and files, and a checkpoint in
use (sampled by a live session, or pinned by a request of this process: a sample request running, a load, a
save, a copy) never does."""

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from server.store.retention import CheckpointPins, sweep_expired_checkpoints
from server.store.store import CheckpointRecord, SamplingSessionRecord, Store, TrainingRunRecord

T0 = datetime(2026, 3, 1, tzinfo=UTC)
NOW = T0 + timedelta(hours=2)


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    store = Store(database_url)
    store.create_session("s1", tags=[], user_metadata={}, sdk_version=None, display_name=None, owner="alice")
    store.create_training_run(TrainingRunRecord(
        model_id="s1:train:0", session_id="s1", owner="alice", base_model="m", model_seq_id=0, lora_rank=8, seed=None,
        train_mlp=True, train_attn=True, train_unembed=True))
    yield store
    store.close()


def save(store: Store, tmp_path: Path, name: str, expires_at: datetime | None,
         created_at: datetime = T0) -> CheckpointRecord:
    directory = tmp_path / name
    directory.mkdir(exist_ok=True)
    (directory / "adapter_model.safetensors").write_bytes(b"weights")
    record = CheckpointRecord(tinker_path=f"tinker://s1:train:0/sampler_weights/{name}", model_id="s1:train:0",
                              checkpoint_id=f"sampler_weights/{name}", checkpoint_type="sampler",
                              directory=str(directory), size_bytes=7, owner="alice", created_at=created_at,
                              expires_at=expires_at)
    store.add_checkpoint(record)
    return record


def sample_from(store: Store, record: CheckpointRecord, session_id: str, sampling_session_id: str) -> None:
    store.create_session(session_id, tags=[], user_metadata={}, sdk_version=None, display_name=None, owner="bob")
    store.create_sampling_session(SamplingSessionRecord(sampling_session_id=sampling_session_id,
                                                        session_id=session_id, owner="bob", base_model="m",
                                                        model_path=record.tinker_path))


def sweep(store: Store, checkpoint_dir: Path, pins: CheckpointPins | None = None) -> list[str]:
    released = []
    removed = sweep_expired_checkpoints(store, pins or CheckpointPins(), NOW, checkpoint_dir,
                                        lambda record: released.append(record.tinker_path))
    assert removed == released
    return removed


def test_only_checkpoints_past_their_expiry_go_with_their_files(store, tmp_path):
    expired = save(store, tmp_path, "expired", expires_at=NOW - timedelta(seconds=1))
    later = save(store, tmp_path, "later", expires_at=NOW + timedelta(seconds=1))
    forever = save(store, tmp_path, "forever", expires_at=None)
    assert sweep(store, tmp_path) == [expired.tinker_path]
    assert store.get_checkpoint(expired.tinker_path) is None and not Path(expired.directory).exists()
    for kept in (later, forever):
        assert store.get_checkpoint(kept.tinker_path) == kept and Path(kept.directory).exists()
    assert sweep(store, tmp_path) == []


def test_a_checkpoint_sampled_by_a_live_session_stays_until_the_session_finishes(store, tmp_path):
    record = save(store, tmp_path, "sampled", expires_at=NOW - timedelta(hours=1))
    sample_from(store, record, "s2", "s2:sample:0")
    assert sweep(store, tmp_path) == [] and Path(record.directory).exists()
    store.finish_session("s2", "success")
    assert sweep(store, tmp_path) == [record.tinker_path]


def test_a_pinned_checkpoint_stays_until_its_last_pin_is_released(store, tmp_path):
    record = save(store, tmp_path, "pinned", expires_at=NOW - timedelta(hours=1))
    pins = CheckpointPins()
    pins.acquire(record.tinker_path)
    pins.acquire(record.tinker_path)
    assert sweep(store, tmp_path, pins) == []
    pins.release(record.tinker_path)
    assert sweep(store, tmp_path, pins) == []
    pins.release(record.tinker_path)
    assert sweep(store, tmp_path, pins) == [record.tinker_path]


def test_a_checkpoint_saved_again_or_given_a_new_ttl_after_it_was_read_is_not_deleted(store, tmp_path):
    old = save(store, tmp_path, "resaved", expires_at=NOW - timedelta(hours=1))
    new = save(store, tmp_path, "resaved", expires_at=NOW - timedelta(hours=1), created_at=T0 + timedelta(minutes=1))
    assert not store.delete_expired_checkpoint(old, NOW)
    store.set_checkpoint_expires_at(new.tinker_path, NOW + timedelta(hours=1))
    assert not store.delete_expired_checkpoint(new, NOW)
    assert store.get_checkpoint(new.tinker_path) is not None


def test_a_pin_taken_during_a_removal_waits_for_it_and_then_finds_the_checkpoint_gone(store, tmp_path):
    record = save(store, tmp_path, "racing", expires_at=NOW - timedelta(hours=1))
    pins = CheckpointPins()
    removing, pin_asked, pinned = threading.Event(), threading.Event(), threading.Event()
    seen_by_pin_holder = []

    def remove() -> bool:
        removing.set()
        assert pin_asked.wait(10)
        assert not pinned.wait(0.2), "a pin was granted while the checkpoint was being removed"
        return store.delete_expired_checkpoint(record, NOW)

    def pin() -> None:
        assert removing.wait(10)
        pin_asked.set()
        with pins.hold(record.tinker_path):
            pinned.set()
            seen_by_pin_holder.append(store.get_checkpoint(record.tinker_path))

    holder = threading.Thread(target=pin)
    holder.start()
    assert pins.remove_unless_pinned(record.tinker_path, remove)
    holder.join(10)
    assert seen_by_pin_holder == [None]
