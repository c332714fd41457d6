"""The scheduler: seq_id order whatever the arrival order, deduplicated retries, failures on the future,
refusals and gaps that never wedge a run, outcomes kept when the journal is full, a bounded shutdown."""

import asyncio
import sqlite3
import threading
import time

import pytest
import sqlalchemy as sa

from server.errors import Conflict, InvalidRequest, NotFound, ShuttingDown
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


def _submit(scheduler: Scheduler, request_id: str, seq_id: int, work=None):
    return scheduler.submit_training(owner="o", request_id=request_id, request_type="X", model_id="s:train:0",
                                     seq_id=seq_id, payload_hash=request_id,
                                     work=work or (lambda: (request_id.encode(), "text/plain")))


def test_a_refused_request_takes_its_seq_id_so_the_requests_behind_it_run(store):
    async def scenario():
        scheduler = await _created_scheduler(store)
        later = await _submit(scheduler, "r2", 2)
        refused = await scheduler.refuse_training(owner="o", request_id="r1", request_type="X", model_id="s:train:0",
                                                  seq_id=1, payload_hash="bad", error=InvalidRequest("bad body"))
        retried = await scheduler.refuse_training(owner="o", request_id="r1-again", request_type="X",
                                                  model_id="s:train:0", seq_id=1, payload_hash="bad",
                                                  error=InvalidRequest("bad body"))
        records = [await scheduler.retrieve(r, timeout=10, owner="o") for r in (refused, later)]
        scheduler.close()
        return retried, records

    retried, (refused, later) = asyncio.run(scenario())
    assert retried == "r1"  # a retried refusal finds the slot's first request
    assert (refused.status, refused.error) == ("failed", "bad body")
    assert later.status == "complete"


def test_a_seq_id_that_never_arrives_fails_the_requests_behind_it_after_the_gap_timeout(store):
    async def scenario():
        scheduler = await _created_scheduler(store)
        scheduler.seq_gap_timeout = 60.0
        behind = [await _submit(scheduler, f"r{seq_id}", seq_id) for seq_id in (3, 4)]
        assert scheduler.fail_stalled_gaps(time.monotonic() + 30) == []  # not yet
        given_up = scheduler.fail_stalled_gaps(time.monotonic() + 61)
        failed = [await scheduler.retrieve(r, timeout=10, owner="o") for r in behind]
        # The run goes on after the gap; the missing seq_id, arriving late, is refused.
        after = await scheduler.retrieve(await _submit(scheduler, "r5", 5), timeout=10, owner="o")
        late = await scheduler.retrieve(await _submit(scheduler, "r1", 1), timeout=10, owner="o")
        scheduler.close()
        return given_up, failed, after, late

    given_up, failed, after, late = asyncio.run(scenario())
    assert given_up == [("s:train:0", 1)]
    assert all(r.status == "failed" and "seq_id 1 of s:train:0 never arrived" in r.error for r in failed)
    assert after.status == "complete" and late.status == "failed"


def test_the_gap_timeout_counts_from_when_the_run_went_idle(store):
    release = threading.Event()

    async def scenario():
        scheduler = await _created_scheduler(store)
        scheduler.seq_gap_timeout = 60.0
        running = await _submit(scheduler, "r1", 1, work=lambda: (release.wait(10), (b"", "text/plain"))[1])
        await _submit(scheduler, "r3", 3)
        # Long past the timeout, but seq 1 still runs: seq 2 is legitimately not sent yet.
        stalled_while_busy = scheduler.fail_stalled_gaps(time.monotonic() + 600)
        release.set()
        await scheduler.retrieve(running, timeout=10, owner="o")
        await asyncio.sleep(0)  # let the completion callback mark the run idle
        scheduler.close()
        return stalled_while_busy

    assert asyncio.run(scenario()) == []


def test_an_outcome_the_journal_cannot_take_is_answered_from_memory_and_journaled_later(store, monkeypatch):
    async def scenario():
        scheduler = await _created_scheduler(store)
        journal_full = sa.exc.OperationalError("UPDATE futures", {},
                                               sqlite3.OperationalError("database or disk is full"))
        original = store.complete_future

        def full(*args, **kwargs):
            raise journal_full

        monkeypatch.setattr(store, "complete_future", full)
        request_id = await _submit(scheduler, "r1", 1)
        answered = await scheduler.retrieve(request_id, timeout=10, owner="o")
        pending_in_journal = store.get_future(request_id).status
        monkeypatch.setattr(store, "complete_future", original)
        await asyncio.to_thread(scheduler._flush_unjournaled)
        scheduler.close()
        return answered, pending_in_journal, store.get_future(request_id)

    answered, pending_in_journal, journaled = asyncio.run(scenario())
    assert (answered.status, answered.result) == ("complete", b"r1") and pending_in_journal == "pending"
    assert (journaled.status, journaled.result) == ("complete", b"r1")


def test_another_tenants_request_id_is_not_found(store):
    async def scenario():
        scheduler = await _created_scheduler(store)
        request_id = await _submit(scheduler, "r1", 1)
        await scheduler.retrieve(request_id, timeout=10, owner="o")
        try:
            with pytest.raises(NotFound):
                await scheduler.retrieve(request_id, timeout=1, owner="someone-else")
        finally:
            scheduler.close()

    asyncio.run(scenario())


def test_close_fails_queued_work_and_gives_running_work_a_bounded_time(store):
    release = threading.Event()

    async def scenario():
        scheduler = await _created_scheduler(store)
        stuck = await _submit(scheduler, "r1", 1, work=lambda: (release.wait(10), (b"", "text/plain"))[1])
        queued = await _submit(scheduler, "r2", 2)
        waiting = await _submit(scheduler, "r4", 4)
        report = scheduler.close(timeout=0.2)
        release.set()
        with pytest.raises(ShuttingDown):
            await _submit(scheduler, "r5", 5)
        return report, [store.get_future(r) for r in (stuck, queued, waiting)]

    report, records = asyncio.run(scenario())
    assert (report.finished, report.cancelled, report.interrupted) == (0, 2, 1)
    assert [r.status for r in records] == ["failed"] * 3
    assert "did not finish within 0.2 s" in records[0].error and "before this request ran" in records[1].error
