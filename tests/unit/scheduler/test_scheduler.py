"""The scheduler: seq_id order whatever the arrival order, deduplicated retries, failures on the future,
refusals and gaps that never wedge a run, outcomes kept when the journal is full, a bounded shutdown;
forward_backward work of several runs in shared, fair passes, and saves that complete once written
while training goes on. A fake executor stands for the trainer: what it is given and in which order
is what these tests look at."""

import asyncio
import sqlite3
import threading
import time
from collections import deque
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
import torch

from server.errors import Conflict, InvalidRequest, NotFound, ShuttingDown
from server.rendering.training import TrainingExample
from server.scheduler.passes import plan_cycle, share_pass
from server.scheduler.requests import TrainingRequest
from server.scheduler.scheduler import Scheduler
from server.store.store import Store, TrainingRunRecord
from server.training.operations import ForwardBackward, SaveState, Unload
from server.training.trainer import ForwardBackwardResult


@pytest.fixture
def store(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/journal.db")
    store.create_session("s", tags=[], user_metadata={}, sdk_version=None, display_name=None, owner="o")
    for index in range(3):
        store.create_training_run(TrainingRunRecord(model_id=f"s:train:{index}", session_id="s", owner="o",
                                                    base_model="m", model_seq_id=index, lora_rank=4, seed=0,
                                                    train_mlp=True, train_attn=True, train_unembed=True))
    yield store
    store.close()


@dataclass(frozen=True)
class Step:
    """A test operation that runs alone: the fake executor logs its name (or does what it was told)."""

    model_id: str
    name: str


class FakeExecutor:
    """Stands for the trainer: logs what it runs, in order; passes log which runs' datums they held."""

    def __init__(self):
        self.log: list[str] = []
        self.actions = {}
        """Step name -> what running it does instead of logging it."""
        self.passes: list[list[tuple[str, int]]] = []
        self.before_pass = None

    def run(self, operation):
        if isinstance(operation, Unload):
            self.log.append(f"unload {operation.model_id}")
            return None
        if isinstance(operation, SaveState):
            self.log.append(f"copy {operation.model_id}")
            return f"state of {operation.model_id}"
        action = self.actions.get(operation.name)
        if action is not None:
            return action()
        self.log.append(operation.name)
        return operation.name

    def run_pass(self, operations):
        if self.before_pass is not None:
            self.before_pass(operations)
        self.passes.append([(operation.model_id, len(operation.examples)) for operation in operations])
        return [ForwardBackwardResult(outputs=[{"tokens": len(e.input_ids)} for e in operation.examples],
                                      datum_metrics=[{} for _ in operation.examples], loss=1.0)
                for operation in operations]


def respond_with_name(result):
    return str(result).encode(), "text/plain"


def _recording_work(log: list, name: str, delay: float = 0.0):
    """What running a step does: wait, then log its name."""
    def work():
        time.sleep(delay)
        log.append(name)
        return name

    return work


async def _created_scheduler(store, executor: FakeExecutor | None = None, **options) -> Scheduler:
    """A scheduler on which model s:train:0 has been created (its requests are accepted from then on)."""
    scheduler = Scheduler(store, executor or FakeExecutor(), **options)
    for index in range(3):
        model_id = f"s:train:{index}"
        created = await scheduler.submit_training(owner="o", request_id=f"create-{index}", request_type="CreateModel",
                                                  model_id=model_id, seq_id=0, payload_hash="c",
                                                  operation=Step(model_id, f"create {index}"),
                                                  respond=respond_with_name)
        await scheduler.retrieve(created, timeout=10, owner="o")
    scheduler.executor.log.clear()
    return scheduler


def _submit(scheduler: Scheduler, request_id: str, seq_id: int, operation=None, model_id: str = "s:train:0",
            respond=respond_with_name, request_type: str = "X"):
    return scheduler.submit_training(owner="o", request_id=request_id, request_type=request_type, model_id=model_id,
                                     seq_id=seq_id, payload_hash=request_id,
                                     operation=operation or Step(model_id, request_id), respond=respond)


def test_training_requests_run_in_seq_id_order_whatever_the_arrival_order(store):
    async def scenario():
        scheduler = await _created_scheduler(store)
        ids = {}
        for seq_id in (3, 2, 4, 1):
            ids[seq_id] = await _submit(scheduler, f"r{seq_id}", seq_id, Step("s:train:0", f"seq{seq_id}"))
        results = [await scheduler.retrieve(ids[s], timeout=10, owner="o") for s in (1, 2, 3, 4)]
        scheduler.close()
        return scheduler.executor.log, results

    log, results = asyncio.run(scenario())
    assert log == ["seq1", "seq2", "seq3", "seq4"]
    assert [r.result for r in results] == [b"seq1", b"seq2", b"seq3", b"seq4"]


def test_a_retry_gets_the_original_request_and_runs_once_while_a_changed_payload_conflicts(store):
    async def scenario():
        scheduler = await _created_scheduler(store)
        step = Step("s:train:0", "step")
        first = await scheduler.submit_training(owner="o", request_id="a", request_type="OptimStep",
                                                model_id="s:train:0", seq_id=1, payload_hash="h", operation=step,
                                                respond=respond_with_name)
        retry = await scheduler.submit_training(owner="o", request_id="b", request_type="OptimStep",
                                                model_id="s:train:0", seq_id=1, payload_hash="h", operation=step,
                                                respond=respond_with_name)
        with pytest.raises(Conflict):
            await scheduler.submit_training(owner="o", request_id="c", request_type="OptimStep", model_id="s:train:0",
                                            seq_id=1, payload_hash="other", operation=step, respond=respond_with_name)
        await scheduler.retrieve(first, timeout=10, owner="o")
        scheduler.close()
        return first, retry, scheduler.executor.log

    first, retry, log = asyncio.run(scenario())
    assert first == retry == "a" and log == ["step"]


def test_a_failing_request_fails_its_future_and_the_next_one_still_runs(store):
    def bad():
        raise InvalidRequest("bad datum")

    def crash():
        raise RuntimeError("boom")

    async def scenario():
        executor = FakeExecutor()
        executor.actions.update(r1=bad, r2=crash)
        scheduler = await _created_scheduler(store, executor)
        for seq_id in (1, 2, 3):
            await _submit(scheduler, f"r{seq_id}", seq_id)
        records = [await scheduler.retrieve(r, timeout=10, owner="o") for r in ("r1", "r2", "r3")]
        scheduler.close()
        return records

    user_error, server_error, ok = asyncio.run(scenario())
    assert (user_error.status, user_error.error, user_error.error_category) == ("failed", "bad datum", "user")
    # An internal error names its type and the request id the server log has the details under.
    assert server_error.error_category == "server" and "RuntimeError" in server_error.error
    assert "r2" in server_error.error and "boom" not in server_error.error
    assert ok.status == "complete"


def test_requests_of_a_model_not_created_since_start_fail_at_once_instead_of_waiting(store):
    async def scenario():
        scheduler = Scheduler(store, FakeExecutor())
        request_id = await _submit(scheduler, "r5", 5)
        record = await scheduler.retrieve(request_id, timeout=10, owner="o")
        scheduler.close()
        return record

    record = asyncio.run(scenario())
    assert record.status == "failed" and "not loaded" in record.error and record.error_category == "user"


def test_retiring_a_model_fails_its_waiting_requests_and_unloads_it_after_its_running_work(store):
    async def scenario():
        executor = FakeExecutor()
        log = executor.log
        executor.actions["r1"] = _recording_work(log, "seq1", delay=0.2)
        scheduler = await _created_scheduler(store, executor)
        running = await _submit(scheduler, "r1", 1)
        waiting = await _submit(scheduler, "r3", 3)
        scheduler.retire_model("s:train:0", lambda: log.append("cleanup"))
        later = await _submit(scheduler, "r2", 2)
        records = [await scheduler.retrieve(r, timeout=10, owner="o") for r in (running, waiting, later)]
        for _ in range(100):  # the unload has no future: wait for its effect
            if "cleanup" in log:
                break
            await asyncio.sleep(0.05)
        scheduler.close()
        return records, log

    (running, waiting, later), log = asyncio.run(scenario())
    assert running.status == "complete" and waiting.status == later.status == "failed"
    assert "not loaded" in waiting.error and "not loaded" in later.error
    assert log == ["seq1", "unload s:train:0", "cleanup"]


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
        executor = FakeExecutor()
        executor.actions["r1"] = lambda: (release.wait(10), "r1")[1]
        scheduler = await _created_scheduler(store, executor)
        scheduler.seq_gap_timeout = 60.0
        running = await _submit(scheduler, "r1", 1)
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
        await asyncio.to_thread(scheduler.futures.flush_unjournaled)
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
    started = threading.Event()

    async def scenario():
        executor = FakeExecutor()
        executor.actions["r1"] = lambda: (started.set(), release.wait(10), "r1")[2]
        scheduler = await _created_scheduler(store, executor)
        stuck = await _submit(scheduler, "r1", 1)
        queued = await _submit(scheduler, "r2", 2)
        waiting = await _submit(scheduler, "r4", 4)
        await asyncio.to_thread(started.wait, 10)
        report = scheduler.close(timeout=0.2)
        release.set()
        with pytest.raises(ShuttingDown):
            await _submit(scheduler, "r5", 5)
        return report, [store.get_future(r) for r in (stuck, queued, waiting)]

    report, records = asyncio.run(scenario())
    assert (report.finished, report.cancelled, report.interrupted) == (0, 2, 1)
    assert [r.status for r in records] == ["failed"] * 3
    assert "did not finish within 0.2 s" in records[0].error and "before this request ran" in records[1].error


# -- passes: several runs in one forward/backward, fairly ------------------------------------------


def forward_backward(model_id: str, lengths: list[int], forward_only: bool = False) -> ForwardBackward:
    examples = [TrainingExample(input_ids=[1] * length, loss_fn_inputs={"target_tokens": torch.zeros(length)})
                for length in lengths]
    return ForwardBackward(model_id, examples, "cross_entropy", None, forward_only)


def test_a_cycle_is_planned_without_taking_anything_off_the_queues():
    def ready(model_id, *operations):
        return deque(TrainingRequest(f"{model_id}-{i}", "X", model_id, op, respond_with_name)
                     for i, op in enumerate(operations))

    queues = {"a": ready("a", Step("a", "optim"), forward_backward("a", [8])),
              "b": ready("b", forward_backward("b", [8, 8]), forward_backward("b", [8], forward_only=True)),
              "c": ready("c", forward_backward("c", [8]))}
    before = {model_id: list(lane) for model_id, lane in queues.items()}
    cycle = plan_cycle(queues, {"b": 3, "c": 2}, pass_tokens=16, pass_runs=None)
    assert [request.request_id for request in cycle.alone] == ["a-0"]
    # c was served longer ago than b; b's forward-only request does not join a forward_backward pass.
    assert [(share.request.request_id, share.num_datums) for share in cycle.passing] == [("c-0", 1), ("b-0", 1)]
    assert cycle.served == ["c", "b"]
    assert {model_id: list(lane) for model_id, lane in queues.items()} == before


def respond_with_outputs(result):
    return ",".join(str(output["tokens"]) for output in result.outputs).encode(), "text/plain"


def test_the_pass_budget_is_shared_equally_then_what_is_left_goes_round_again():
    # Eight runs of 8 x 1,024 tokens fit one 65,536-token pass exactly.
    assert share_pass([[1024] * 8] * 8, 65536) == [8] * 8
    # A long job and a small step: the small one is whole in the first pass, the long one takes the rest.
    assert share_pass([[2048] * 32, [1024] * 8], 65536) == [28, 8]
    # Runs whose datums outgrow their share each get their next datum while the budget has room.
    assert share_pass([[2048] * 4] * 8, 8192) == [1, 1, 1, 1, 0, 0, 0, 0]
    # A run alone takes the whole budget; one datum over the budget still runs, alone.
    assert share_pass([[100] * 50], 1000) == [10]
    assert share_pass([[5000], [10]], 1000) == [1, 0]


@pytest.mark.parametrize("pass_runs,expected", [
    (None, [[("s:train:0", 2), ("s:train:1", 2)]]),
    (1, [[("s:train:0", 2)], [("s:train:1", 2)]]),  # one run at a time, in turn
])
def test_forward_backward_requests_of_several_runs_share_one_pass(store, pass_runs, expected):
    hold = threading.Event()

    async def scenario():
        executor = FakeExecutor()
        executor.actions["block"] = lambda: (hold.wait(10), "block")[1]
        scheduler = await _created_scheduler(store, executor, pass_runs=pass_runs)
        # While run 2 holds the training thread, runs 0 and 1 queue forward_backward work.
        blocker = await _submit(scheduler, "block", 1, model_id="s:train:2")
        ids = [await _submit(scheduler, f"fb{index}", 1, forward_backward(f"s:train:{index}", [3, 4]),
                             model_id=f"s:train:{index}", respond=respond_with_outputs) for index in (0, 1)]
        hold.set()
        records = [await scheduler.retrieve(r, timeout=10, owner="o") for r in [blocker, *ids]]
        scheduler.close()
        return executor.passes, records

    passes, records = asyncio.run(scenario())
    assert passes == expected
    assert [r.result for r in records] == [b"block", b"3,4", b"3,4"]


def test_a_long_request_of_one_run_does_not_hold_another_runs_small_one(store):
    async def scenario():
        executor = FakeExecutor()
        scheduler = await _created_scheduler(store, executor, pass_tokens=40)
        arrived = asyncio.Event()
        loop = asyncio.get_running_loop()
        # The small request arrives while the long one's first pass runs.
        executor.before_pass = lambda operations: (
            len(executor.passes) == 0 and asyncio.run_coroutine_threadsafe(small_sent(), loop).result(10))
        done = []

        def finishing(name):
            def respond(result):  # outcomes are recorded in the order their requests finished
                done.append(name)
                return respond_with_outputs(result)
            return respond

        async def small_sent():
            small_ids.append(await _submit(scheduler, "small", 1, forward_backward("s:train:1", [10]),
                                           model_id="s:train:1", respond=finishing("small")))
            arrived.set()

        small_ids = []
        long = await _submit(scheduler, "long", 1, forward_backward("s:train:0", [10] * 12), respond=finishing("long"))
        await arrived.wait()
        records = [await scheduler.retrieve(request_id, timeout=10, owner="o") for request_id in (long, small_ids[0])]
        scheduler.close()
        return executor.passes, done, records

    passes, done, (long, small) = asyncio.run(scenario())
    assert done == ["small", "long"]
    # Passes of 40 tokens: the long request alone, then the small one (never served: first) shares one
    # with it, then the long one alone again.
    assert passes == [[("s:train:0", 4)], [("s:train:1", 1), ("s:train:0", 3)], [("s:train:0", 4)],
                      [("s:train:0", 1)]]
    assert long.result == b",".join([b"10"] * 12) and small.result == b"10"


def test_a_saves_future_completes_once_written_while_the_runs_next_steps_go_on(store):
    written = threading.Event()

    async def scenario():
        executor = FakeExecutor()
        scheduler = await _created_scheduler(store, executor)

        def write(state):  # stands for the checkpoint's files and row
            written.wait(10)
            return f"written {state}".encode(), "text/plain"

        save = await _submit(scheduler, "save", 1, SaveState("s:train:0", with_optimizer=True), respond=write)
        step = await _submit(scheduler, "step", 2)
        stepped = await scheduler.retrieve(step, timeout=10, owner="o")
        save_pending = await scheduler.retrieve(save, timeout=0.1, owner="o")
        written.set()
        saved = await scheduler.retrieve(save, timeout=10, owner="o")
        scheduler.close()
        return executor.log, stepped, save_pending, saved

    log, stepped, save_pending, saved = asyncio.run(scenario())
    assert log == ["copy s:train:0", "step"]
    assert stepped.status == "complete" and save_pending is None
    assert saved.result == b"written state of s:train:0"
