"""Futures, per-run seq_id order, retry deduplication, refusals, gaps, fair training passes and the
worker threads.

Every submitted request is journaled as a future before it is acknowledged. A run's training
requests become ready strictly in seq_id order (the SDK sends a forward_backward's chunks
concurrently, the first one last); a retry with a (model_id, seq_id) already journaled gets the
original request id and never runs twice. A refused request still takes its seq_id (as a failed
future), and a seq_id that never arrives fails the requests queued behind it after a bounded wait,
so one bad call never wedges a run.

Ready requests are typed operations (training/operations.py), run by one training thread through
the executor in cycles: first each run's next operation that is not a forward_backward (optim_step,
a save's copy, a load: short), then one pass of forward_backward / forward operations of several
runs together, shared fairly under a token budget (scheduler/passes.py); a request bigger than its
share goes on in the next pass. So eight tenants' small steps take one pass, and no tenant's long
job holds another's small step for more than a pass. Outcomes are recorded off the training thread,
in the order the operations ran: the finisher journals each result (and what its route records with
it) while the next cycle computes, and the checkpoint writer writes a save's host copy first.
Waiters are woken in memory; the database is only the journal, and an outcome it cannot take (a full
disk) is kept in memory and answered from there until it can. Sampling never comes here: its futures
live in memory (sampling.py).
"""

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from server.errors import Conflict, InvalidRequest, NotFound, ShuttingDown, TinkerServerError
from server.metrics import ServerMetrics
from server.scheduler.outcomes import Outcome, failure_of
from server.scheduler.passes import share_pass
from server.store.db import storage_failure
from server.store.store import FutureRecord, Store
from server.training.executor import TrainingExecutor
from server.training.operations import ForwardBackward, Operation, SaveState, Unload

logger = logging.getLogger(__name__)

CREATION_SEQ_ID = 0
# Saves copied but not yet written: a client saving faster than the disk takes holds the training
# thread here, so that host copies never pile up.
MAX_PENDING_WRITES = 2
# Outcomes handed to the finisher and not yet recorded: a journal slower than training holds the
# training thread here, so that results never pile up in memory.
MAX_PENDING_FINISHES = 64

Respond = Callable[[Any], tuple[bytes, str]]
"""Turns an operation's result into the future's payload and content type, recording what the route
needs recorded (a checkpoint's files and row, a run's row); runs after the operation, never on the
event loop."""


@dataclass
class TrainingRequest:
    """A journaled training request whose turn has come (or is waiting for it)."""

    request_id: str | None
    """None for the scheduler's own operations (unloading a retired run), which have no future."""
    request_type: str
    model_id: str
    operation: Operation
    respond: Respond
    release: Callable[[], None] | None = None
    """Called once the request is over, whatever its outcome (a load's hold on its checkpoint)."""
    sequenced: bool = False
    """Counted in its run's queue (it came in seq_id order, not as a creation or without a seq_id)."""
    started: float | None = None
    done: int = 0
    """forward_backward: datums run so far (a request may span several passes)."""
    result: Any = None
    """forward_backward: the outputs of the datums run so far."""


@dataclass
class _ModelQueue:
    """Requests of one training model waiting for their turn; None marks a refused (already failed) seq_id."""

    next_seq_id: int = 1
    waiting: dict[int, TrainingRequest | None] = field(default_factory=dict)
    arrived_at: dict[int, float] = field(default_factory=dict)
    in_flight: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    """When the model's last dispatched request finished: a gap is timed from here."""


@dataclass(frozen=True)
class ShutdownReport:
    """What `Scheduler.close` did with the work it still had."""

    finished: int
    """Running requests that ended within the timeout."""
    cancelled: int
    """Queued requests failed without running."""
    interrupted: int
    """Running requests failed because they outlived the timeout (their threads are abandoned)."""


def _not_loaded(model_id: str) -> str:
    return (f"model {model_id} is not loaded on this server (its session was closed or the server restarted); "
            f"create it again from a checkpoint with create_training_client_from_state")


class Scheduler:
    def __init__(self, store: Store, executor: TrainingExecutor, *, pass_tokens: int = 65536, pass_runs: int | None = None, seq_gap_timeout: float = 120.0,
                 metrics: ServerMetrics | None = None, hidden_paths: tuple[str, ...] = ()):
        """
        Args:
            pass_tokens: the token budget of one forward_backward pass, shared among the runs with work.
            pass_runs: at most this many runs in one pass (None: no limit; 1: one run at a time, in turn).
        """
        self.store = store
        self.executor = executor
        self.pass_tokens = pass_tokens
        self.pass_runs = pass_runs
        self.seq_gap_timeout = seq_gap_timeout
        self.metrics = metrics or ServerMetrics()
        self._hidden_paths = hidden_paths
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._write_slots = threading.Semaphore(MAX_PENDING_WRITES)
        # A step's results take several database commits (the future, the run's metrics): on the
        # training thread they would leave the accelerator idle between cycles.
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="finisher")
        self._finish_slots = threading.Semaphore(MAX_PENDING_FINISHES)
        self._queues: dict[str, _ModelQueue] = {}
        """Event loop only: each run's requests waiting for their seq_id's turn."""
        self._lock = threading.Condition()
        self._ready: dict[str, deque[TrainingRequest]] = {}
        """Each run's requests whose turn came, in order (shared with the training thread, under _lock)."""
        self._last_served: dict[str, int] = {}
        """The pass in which each run last had datums: passes are shared least recently served first."""
        self._passes = 0
        self._running: dict[str, TrainingRequest] = {}
        """Training requests taken off the ready queues and not finished (a save's until it is written)."""
        self._finishing = threading.Lock()
        """Held while an outcome is recorded, so that close() never fails a request that just finished."""
        self._abandoned: set[str] = set()
        self._stopping = False
        self._waiters: dict[str, asyncio.Event] = {}
        self._unjournaled: dict[str, Outcome] = {}
        """Outcomes the journal could not take yet (a full disk), answered from memory meanwhile."""
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._training = threading.Thread(target=self._train, name="training", daemon=True)
        self._training.start()

    async def submit_training(self, *, request_id: str, request_type: str, owner: str, model_id: str,
                              seq_id: int | None, payload_hash: str, operation: Operation, respond: Respond,
                              release: Callable[[], None] | None = None) -> str:
        """Journal a training-side request and run it in its model's seq_id order; returns its request id.

        A model's creation (create_model or create-via-load) is journaled as seq_id 0, so a retried
        creation is deduplicated too, and runs at once; the SDK numbers the model's later requests
        from 1. A request without a seq_id also runs at once. `release` is called once the request is
        over, whether it ran, failed or was never run.
        """
        try:
            record = await self._journal(request_id, request_type, owner, model_id, seq_id, payload_hash)
        except BaseException:
            if release is not None:
                release()
            raise
        if record.request_id != request_id:
            if release is not None:
                release()
            return record.request_id
        request = TrainingRequest(request_id, request_type, model_id, operation, respond, release)
        if seq_id == CREATION_SEQ_ID:
            self._queues[model_id] = _ModelQueue()
        if seq_id is None or seq_id == CREATION_SEQ_ID:
            self._make_ready(request)
            return request_id
        queue = self._queues.get(model_id)
        if queue is None:
            # Not created since this server started, or its session was closed: it would wait forever.
            self._fail_unrun(request, NotFound(_not_loaded(model_id)))
            return request_id
        if seq_id < queue.next_seq_id:
            self._fail_unrun(request, InvalidRequest(
                f"seq_id {seq_id} of {model_id} comes after seq_id {queue.next_seq_id - 1} already ran (or was "
                f"skipped when it never arrived)"))
            return request_id
        queue.waiting[seq_id] = request
        queue.arrived_at[seq_id] = time.monotonic()
        self._advance(model_id, queue)
        return request_id

    async def refuse_training(self, *, request_id: str, request_type: str, owner: str, model_id: str, seq_id: int,
                              payload_hash: str, error: TinkerServerError) -> str:
        """Journal a refused request as failed in its (model_id, seq_id) slot, so the model's later requests go on.

        Returns the slot's request id (a retried refusal finds the first one). Raises Conflict when the
        slot already holds a different request.
        """
        record = await self._journal(request_id, request_type, owner, model_id, seq_id, payload_hash)
        if record.request_id != request_id:
            return record.request_id
        self._fail_now(request_id, error)
        queue = self._queues.get(model_id)
        if queue is not None and seq_id >= queue.next_seq_id:
            queue.waiting[seq_id] = None
            queue.arrived_at[seq_id] = time.monotonic()
            self._advance(model_id, queue)
        return request_id

    def retire_model(self, model_id: str, then: Callable[[], None]) -> None:
        """Stop accepting a model's requests and unload it after its ready requests, then call `then`
        (on the training thread).

        Requests still waiting for an earlier seq_id fail now; later ones fail as not loaded.
        """
        queue = self._queues.pop(model_id, None)
        for request in (queue.waiting.values() if queue else []):
            if request is not None:
                self._fail_unrun(request, NotFound(_not_loaded(model_id)))
        self.metrics.forget_run(model_id)
        if not self._closing:
            self._make_ready(TrainingRequest(None, "Unload", model_id, Unload(model_id), lambda _: then()))

    def fail_stalled_gaps(self, now: float | None = None) -> list[tuple[str, int]]:
        """Fail the requests queued behind a seq_id that has not arrived within the gap timeout.

        The timeout counts from when the model went idle (its last dispatched request finished) or the
        first request queued behind the gap arrived, whichever is later, so a gap is never blamed for
        time the run spent computing. The run then goes on after the failed requests. Returns the
        (model_id, missing seq_id) pairs it gave up on.
        """
        now = time.monotonic() if now is None else now
        given_up = []
        for model_id, queue in self._queues.items():
            if not queue.waiting or queue.in_flight:
                continue
            first_waiting = min(queue.arrived_at.values())
            if now - max(queue.idle_since, first_waiting) < self.seq_gap_timeout:
                continue
            missing = queue.next_seq_id
            error = InvalidRequest(f"seq_id {missing} of {model_id} never arrived within {self.seq_gap_timeout:g} s "
                                   f"(it was lost, or refused before its seq_id could be read); the requests "
                                   f"queued behind it are failed and the run goes on")
            for seq_id in sorted(queue.waiting):
                request = queue.waiting.pop(seq_id)
                if request is not None:
                    self._fail_unrun(request, error)
                queue.next_seq_id = seq_id + 1
            queue.arrived_at.clear()
            given_up.append((model_id, missing))
            logger.warning("event=seq_gap_timeout model_id=%s missing_seq_id=%d", model_id, missing)
        return given_up

    async def watch(self, interval: float) -> None:
        """Housekeeping every `interval` seconds: close stalled gaps, journal outcomes kept in memory."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.fail_stalled_gaps()
                if self._unjournaled:
                    await asyncio.to_thread(self._flush_unjournaled)
            except Exception:  # a database hiccup must not end the loop: the next round tries again
                logger.exception("scheduler housekeeping failed")

    async def retrieve(self, request_id: str, timeout: float, *, owner: str) -> Outcome | None:
        """The owner's finished request, or None if it is still pending after waiting up to `timeout` seconds.

        Another tenant's request id is not found (404), exactly like an unknown one.
        """
        event = self._waiters.get(request_id)  # taken before reading, so a wake-up in between is not lost
        record = await self._read(request_id)
        if record.owner != owner:
            raise NotFound(f"no request {request_id}")
        outcome = self._outcome_of(record)
        if outcome is not None or event is None:
            return outcome
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return None
        return self._outcome_of(await self._read(request_id))

    def close(self, timeout: float = 30.0) -> ShutdownReport:
        """Accept no more work, fail what is queued, give running requests `timeout` seconds, fail the rest."""
        self._closing = True
        stopping = ShuttingDown("the server shut down before this request ran; send it again once it is back")
        queued = [request for model_id in list(self._queues)
                  for request in self._queues.pop(model_id).waiting.values() if request is not None]
        with self._lock:
            self._stopping = True
            queued += [request for lane in self._ready.values() for request in lane if request.request_id is not None]
            self._ready.clear()
            running = dict.fromkeys(self._running)
            self._lock.notify_all()
        for request in queued:
            self._record(request.request_id, Outcome.failure(stopping))
            if request.release is not None:
                request.release()
        with self._lock:
            self._lock.wait_for(lambda: not running.keys() & self._running.keys(), timeout)
        with self._finishing, self._lock:
            unfinished = [request_id for request_id in running if request_id in self._running]
            self._abandoned.update(unfinished)
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._finisher.shutdown(wait=False, cancel_futures=True)
        interrupted = ShuttingDown(f"the server shut down while this request ran (it did not finish within "
                                   f"{timeout:g} s); its effect is lost: send it again once the server is back")
        for request_id in unfinished:
            self._record(request_id, Outcome.failure(interrupted))
        self._flush_unjournaled()
        return ShutdownReport(finished=len(running) - len(unfinished), cancelled=len(queued),
                              interrupted=len(unfinished))

    async def _read(self, request_id: str) -> FutureRecord:
        record = await asyncio.to_thread(self.store.get_future, request_id)
        if record is None:
            raise NotFound(f"no request {request_id}")
        return record

    def _outcome_of(self, record: FutureRecord) -> Outcome | None:
        """A journaled request's outcome (the one kept in memory while the journal cannot take it); None if pending."""
        kept = self._unjournaled.get(record.request_id)
        if kept is not None or record.status == "pending":
            return kept
        return Outcome(record.status, result=record.result, content_type=record.content_type, error=record.error,
                       error_category=record.error_category)

    async def _journal(self, request_id: str, request_type: str, owner: str, model_id: str, seq_id: int | None,
                       payload_hash: str) -> FutureRecord:
        if self._closing:
            raise ShuttingDown("the server is shutting down; send the request again once it is back")
        self._loop = asyncio.get_running_loop()
        try:
            record = await asyncio.to_thread(self.store.insert_future, request_id=request_id,
                                             request_type=request_type, model_id=model_id, seq_id=seq_id,
                                             payload_hash=payload_hash, owner=owner)
        except Exception as error:
            raise storage_failure(error, "journal this request") from error
        if record.request_id != request_id and (record.payload_hash != payload_hash
                                                or record.request_type != request_type):
            raise Conflict(f"seq_id {seq_id} of {model_id} was already used by a different {record.request_type} "
                           f"request")
        if record.request_id == request_id:
            self._waiters[request_id] = asyncio.Event()
        return record

    def _advance(self, model_id: str, queue: _ModelQueue) -> None:
        """Make the run's requests ready while the next seq_id is there."""
        while queue.next_seq_id in queue.waiting:
            request = queue.waiting.pop(queue.next_seq_id)
            del queue.arrived_at[queue.next_seq_id]
            queue.next_seq_id += 1
            if request is not None:
                queue.in_flight += 1
                request.sequenced = True
                self._make_ready(request)
        self.metrics.set_queue_depth(model_id, len(queue.waiting) + queue.in_flight)

    def _make_ready(self, request: TrainingRequest) -> None:
        with self._lock:
            self._ready.setdefault(request.model_id, deque()).append(request)
            self._lock.notify_all()

    # -- the training thread ---------------------------------------------------------------------

    def _train(self) -> None:
        """Run cycles until closed: each run's next operation that is not a forward_backward, then one pass."""
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stopping or any(self._ready.values()))
                if self._stopping:
                    return
                alone, passing = self._next_cycle()
                for request in [*alone, *(request for request, _ in passing)]:
                    if request.request_id is not None:
                        self._running[request.request_id] = request
            for request in alone:
                request.started = time.perf_counter()
                self._run_alone(request)
            if passing:
                started = time.perf_counter()
                for request, _ in passing:  # a request's work: from its first pass to its result
                    request.started = request.started or started
                self._run_pass(passing)

    def _next_cycle(self) -> tuple[list[TrainingRequest], list[tuple[TrainingRequest, int]]]:
        """Take each run's next request that runs alone, and the next pass (under _lock): requests with how
        many more of their datums the pass runs."""
        for model_id in [model_id for model_id, lane in self._ready.items() if not lane]:
            del self._ready[model_id]
            self._last_served.pop(model_id, None)
        alone, offers = [], []
        for model_id, lane in self._ready.items():
            if not isinstance(lane[0].operation, ForwardBackward):
                alone.append(lane.popleft())
            else:
                offers.append(model_id)
        if not offers:
            return alone, []
        offers.sort(key=lambda model_id: self._last_served.get(model_id, -1))
        offers = offers[:self.pass_runs]
        forward_only = self._ready[offers[0]][0].operation.forward_only
        streams = {}
        for model_id in offers:
            stream = []
            for request in self._ready[model_id]:
                operation = request.operation
                if not isinstance(operation, ForwardBackward) or operation.forward_only != forward_only:
                    break
                stream.append(request)
            if stream:
                streams[model_id] = stream
        taken = share_pass([[tokens for request in stream for tokens in request.operation.datum_tokens()[request.done:]]
                            for stream in streams.values()], self.pass_tokens)
        self._passes += 1
        passing = []
        for (model_id, stream), count in zip(streams.items(), taken):
            if count:
                self._last_served[model_id] = self._passes
            for request in stream:
                if count == 0:
                    break
                datums = min(count, len(request.operation.examples) - request.done)
                passing.append((request, datums))
                self._ready[model_id].popleft()
                count -= datums
        return alone, passing

    def _run_alone(self, request: TrainingRequest) -> None:
        try:
            result = self.executor.run(request.operation)
        except Exception as error:
            self._finish_later(request, error=error)
            return
        if isinstance(request.operation, SaveState):
            # The copy is taken; the disk is the writer's wait, not the next step's.
            self._write_slots.acquire()
            try:
                self._writer.submit(self._write, request, result)
            except RuntimeError:  # the writer is shut down: the server is stopping
                self._write_slots.release()
                self._finish(request, error=ShuttingDown("the server shut down before this checkpoint was written"))
            return
        self._finish_later(request, result)

    def _write(self, request: TrainingRequest, state) -> None:
        try:
            self._finish(request, state)
        finally:
            self._write_slots.release()

    def _run_pass(self, passing: list[tuple[TrainingRequest, int]]) -> None:
        """One forward/backward over a slice of each request's datums; a request whose last datum ran finishes."""
        pieces = [dataclasses.replace(request.operation, examples=request.operation.examples[
            request.done:request.done + datums]) for request, datums in passing]
        self.metrics.observe_pass(len({request.model_id for request, _ in passing}),
                                  sum(len(e.input_ids) for piece in pieces for e in piece.examples))
        outcomes = self.executor.run_pass(pieces)
        unfinished = []
        for (request, datums), outcome in zip(passing, outcomes):
            if isinstance(outcome, Exception):
                self._finish_later(request, error=outcome)
                continue
            if request.result is None:
                request.result = outcome
            else:
                request.result.extend(outcome)
            request.done += datums
            if request.done == len(request.operation.examples):
                self._finish_later(request, request.result)
            else:
                unfinished.append(request)
        with self._lock:
            stopping = self._stopping
            if not stopping:
                for request in reversed(unfinished):  # back at the front of its run's queue
                    self._running.pop(request.request_id, None)
                    self._ready.setdefault(request.model_id, deque()).appendleft(request)
                self._lock.notify_all()
        for request in unfinished if stopping else []:
            self._finish(request, error=ShuttingDown("the server shut down while this request ran (part of its "
                                                     "datums had run); its effect is lost: send it again once the "
                                                     "server is back"))

    def _finish_later(self, request: TrainingRequest, result: Any = None, error: Exception | None = None) -> None:
        """Training thread: have the finisher record the outcome, in order, while training goes on."""
        self._finish_slots.acquire()
        try:
            self._finisher.submit(self._finish_and_release, request, result, error)
        except RuntimeError:  # the finisher is shut down: the server is stopping
            self._finish_slots.release()
            self._finish(request, result, error)

    def _finish_and_release(self, request: TrainingRequest, result: Any, error: Exception | None) -> None:
        try:
            self._finish(request, result, error)
        finally:
            self._finish_slots.release()

    def _finish(self, request: TrainingRequest, result: Any = None, error: Exception | None = None) -> None:
        """Turn an operation's result into its future's outcome (through the route's `respond`) and record it."""
        request_id = request.request_id
        if request_id is None:  # the scheduler's own operation: nobody waits for it
            try:
                if error is None:
                    request.respond(result)
            except Exception:
                logger.exception("event=cleanup_failed model_id=%s", request.model_id)
            return
        if error is None:
            try:
                outcome = Outcome.success(*request.respond(result))
            except Exception as raised:
                error = raised
        if error is not None:
            outcome = failure_of(error, request_id, self._hidden_paths, request.model_id)
        if request.release is not None:
            request.release()
        self.metrics.observe_request(request.request_type, outcome.status, time.perf_counter() - request.started)
        with self._finishing:
            if request_id in self._abandoned:
                return  # close() failed it already
            self._record(request_id, outcome)
            with self._lock:
                self._running.pop(request_id, None)
                self._lock.notify_all()
        self._loop.call_soon_threadsafe(self._finished, request_id, request.model_id if request.sequenced else None)

    # -- outcomes ------------------------------------------------------------------------------------

    def _journal_outcome(self, request_id: str, outcome: Outcome) -> None:
        if outcome.status == "complete":
            self.store.complete_future(request_id, result=outcome.result, content_type=outcome.content_type)
        else:
            self.store.fail_future(request_id, error=outcome.error, category=outcome.error_category)

    def _record(self, request_id: str, outcome: Outcome) -> None:
        """Journal a finished future's outcome; if the journal cannot take it, keep it in memory."""
        try:
            self._journal_outcome(request_id, outcome)
        except Exception:
            logger.warning("event=journal_write_failed request_id=%s: the outcome is kept in memory until the "
                           "journal can take it", request_id, exc_info=True)
            self._unjournaled[request_id] = outcome
            self.metrics.unjournaled.set(len(self._unjournaled))

    @property
    def num_unjournaled(self) -> int:
        """Outcomes held in memory because the journal could not take them (its disk is full)."""
        return len(self._unjournaled)

    def _flush_unjournaled(self) -> None:
        for request_id, outcome in list(self._unjournaled.items()):
            try:
                self._journal_outcome(request_id, outcome)
            except Exception:
                return  # still full: try again on the next round
            del self._unjournaled[request_id]
        self.metrics.unjournaled.set(len(self._unjournaled))

    def _fail_unrun(self, request: TrainingRequest, error: TinkerServerError) -> None:
        """Fail a request that will never run (unloaded, or behind a gap) and let go of what it holds."""
        self._fail_now(request.request_id, error)
        if request.release is not None:
            request.release()

    def _fail_now(self, request_id: str, error: TinkerServerError) -> None:
        """Fail a journaled future that will never run (refused, unloaded, or behind a gap)."""
        self._record(request_id, Outcome.failure(error, self._hidden_paths))
        self._finished(request_id, None)

    def _finished(self, request_id: str, model_id: str | None) -> None:
        event = self._waiters.pop(request_id, None)
        if event is not None:
            event.set()
        queue = self._queues.get(model_id) if model_id is not None else None
        if queue is not None:
            queue.in_flight -= 1
            queue.idle_since = time.monotonic()
            self.metrics.set_queue_depth(model_id, len(queue.waiting) + queue.in_flight)
