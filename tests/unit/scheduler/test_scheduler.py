"""The scheduler: seq_id order whatever the arrival order, deduplicated retries, failures on the future."""

import asyncio
import threading
import time

import pytest

from server.errors import Conflict, InvalidRequest
from server.scheduler.scheduler import Scheduler
from server.store.store import Store, TrainingRunRecord


@pytest.fixture
def store(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/journal.db")
    store.create_session("s", tags=[], user_metadata={}, sdk_version=None, display_name=None, owner="o")
    store.create_training_run(TrainingRunRecord(model_id="s:train:0", session_id="s", owner="o", base_model="m",
                                                model_seq_id=0, lora_rank=4, seed=0, train_mlp=True,
                                                train_attn=True, train_unembed=True))
    yield store
    store.close()


def _recording_work(log: list, name: str, delay: float = 0.0):
    def work():
        time.sleep(delay)
        log.append(name)
        return name.encode(), "text/plain"

    return work


async def _created_scheduler(store) -> Scheduler:
    """A scheduler on which model s:train:0 has been created (its requests are accepted from then on)."""
    scheduler = Scheduler(store)
    created = await scheduler.submit_training(owner="o",
                                              request_id="create", request_type="CreateModel", model_id="s:train:0",
                                              seq_id=0, payload_hash="c", work=lambda: (b"", "text/plain"))
    await scheduler.retrieve(created, timeout=10, owner="o")
    return scheduler


def test_training_requests_run_in_seq_id_order_whatever_the_arrival_order(store):
    async def scenario():
        scheduler = await _created_scheduler(store)
        log = []
        ids = {}
        for seq_id in (3, 2, 4, 1):
            ids[seq_id] = await scheduler.submit_training(
                owner="o", request_id=f"r{seq_id}", request_type="ForwardBackward", model_id="s:train:0", seq_id=seq_id,
                payload_hash=str(seq_id), work=_recording_work(log, f"seq{seq_id}"))
        results = [await scheduler.retrieve(ids[s], timeout=10, owner="o") for s in (1, 2, 3, 4)]
        scheduler.close()
        return log, results

    log, results = asyncio.run(scenario())
    assert log == ["seq1", "seq2", "seq3", "seq4"]
    assert [r.result for r in results] == [b"seq1", b"seq2", b"seq3", b"seq4"]


def test_a_retry_gets_the_original_request_and_runs_once_while_a_changed_payload_conflicts(store):
    async def scenario():
        scheduler = await _created_scheduler(store)
        log = []
        first = await scheduler.submit_training(owner="o",
                                                request_id="a", request_type="OptimStep", model_id="s:train:0",
                                                seq_id=1, payload_hash="h", work=_recording_work(log, "step"))
        retry = await scheduler.submit_training(owner="o",
                                                request_id="b", request_type="OptimStep", model_id="s:train:0",
                                                seq_id=1, payload_hash="h", work=_recording_work(log, "step"))
        with pytest.raises(Conflict):
            await scheduler.submit_training(owner="o", request_id="c", request_type="OptimStep", model_id="s:train:0",
                                            seq_id=1, payload_hash="other", work=_recording_work(log, "step"))
        await scheduler.retrieve(first, timeout=10, owner="o")
        scheduler.close()
        return first, retry, log

    first, retry, log = asyncio.run(scenario())
    assert first == retry == "a" and log == ["step"]


def test_a_failing_request_fails_its_future_and_the_next_one_still_runs(store):
    def bad():
        raise InvalidRequest("bad datum")

    def crash():
        raise RuntimeError("boom")

    async def scenario():
        scheduler = await _created_scheduler(store)
        log = []
        await scheduler.submit_training(owner="o", request_id="r1", request_type="X", model_id="s:train:0", seq_id=1,
                                        payload_hash="1", work=bad)
        await scheduler.submit_training(owner="o", request_id="r2", request_type="X", model_id="s:train:0", seq_id=2,
                                        payload_hash="2", work=crash)
        await scheduler.submit_training(owner="o", request_id="r3", request_type="X", model_id="s:train:0", seq_id=3,
                                        payload_hash="3", work=_recording_work(log, "ok"))
        records = [await scheduler.retrieve(r, timeout=10, owner="o") for r in ("r1", "r2", "r3")]
        scheduler.close()
        return records

    user_error, server_error, ok = asyncio.run(scenario())
    assert (user_error.status, user_error.error, user_error.error_category) == ("failed", "bad datum", "user")
    # An internal error names its type and the request id the server log has the details under.
    assert server_error.error_category == "server" and "RuntimeError" in server_error.error
    assert "r2" in server_error.error and "boom" not in server_error.error
    assert ok.status == "complete"


def test_sampling_does_not_wait_behind_training(store):
    release = threading.Event()

    def slow_training():
        release.wait(10)
        return b"trained", "text/plain"

    async def scenario():
        scheduler = await _created_scheduler(store)
        training = await scheduler.submit_training(owner="o", request_id="t", request_type="X", model_id="s:train:0",
                                                   seq_id=1, payload_hash="t", work=slow_training)
        sample = await scheduler.submit_sampling(owner="o",
                                                 request_id="smp", sampling_session_id="s:sample:0", seq_id=0,
                                                 payload_hash="x", work=lambda: (b"sampled", "text/plain"))
        sampled = await scheduler.retrieve(sample, timeout=5, owner="o")
        still_training = await scheduler.retrieve(training, timeout=0.1, owner="o")
        release.set()
        trained = await scheduler.retrieve(training, timeout=10, owner="o")
        scheduler.close()
        return sampled, still_training, trained

    sampled, still_training, trained = asyncio.run(scenario())
    assert sampled.result == b"sampled" and still_training is None and trained.result == b"trained"


def test_requests_of_a_model_not_created_since_start_fail_at_once_instead_of_waiting(store):
    async def scenario():
        scheduler = Scheduler(store)
        request_id = await scheduler.submit_training(owner="o", request_id="r5", request_type="X", model_id="s:train:0",
                                                     seq_id=5, payload_hash="5", work=lambda: (b"", "text/plain"))
        record = await scheduler.retrieve(request_id, timeout=10, owner="o")
        scheduler.close()
        return record

    record = asyncio.run(scenario())
    assert record.status == "failed" and "not loaded" in record.error and record.error_category == "user"


def test_retiring_a_model_fails_its_waiting_requests_and_cleans_up_after_its_running_work(store):
    log = []

    async def scenario():
        scheduler = await _created_scheduler(store)
        running = await scheduler.submit_training(owner="o",
                                                  request_id="r1", request_type="X", model_id="s:train:0", seq_id=1,
                                                  payload_hash="1", work=_recording_work(log, "seq1", delay=0.2))
        waiting = await scheduler.submit_training(owner="o",
                                                  request_id="r3", request_type="X", model_id="s:train:0", seq_id=3,
                                                  payload_hash="3", work=_recording_work(log, "seq3"))
        scheduler.retire_model("s:train:0", lambda: log.append("cleanup"))
        later = await scheduler.submit_training(owner="o",
                                                request_id="r2", request_type="X", model_id="s:train:0", seq_id=2,
                                                payload_hash="2", work=_recording_work(log, "seq2"))
        records = [await scheduler.retrieve(r, timeout=10, owner="o") for r in (running, waiting, later)]
        scheduler.close()
        return records

    running, waiting, later = asyncio.run(scenario())
    assert running.status == "complete" and waiting.status == later.status == "failed"
    assert "not loaded" in waiting.error and "not loaded" in later.error
    assert log == ["seq1", "cleanup"]
