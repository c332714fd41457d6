"""Futures, per-model seq_id order, retry deduplication, refusals, gaps and the worker threads.

Every submitted request is journaled as a future before it is acknowledged. A model's training
requests run strictly in seq_id order (the SDK sends a forward_backward's chunks concurrently,
the first one last); a retry with a (model_id, seq_id) already journaled gets the original
request id and never runs twice. A refused request still takes its seq_id (as a failed future),
and a seq_id that never arrives fails the requests queued behind it after a bounded wait, so one
bad call never wedges a run. Training has one worker thread and sampling its own (several when the
engine batches concurrent requests), so sampling never waits behind training. Waiters are woken in
memory; the database is only the journal, and an outcome it cannot take (a full disk) is kept in
memory and answered from there until it can.
"""

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from server.errors import (Conflict, InsufficientStorage, InvalidRequest, NotFound, ShuttingDown, TinkerServerError,
                           without_server_paths)
from server.metrics import ServerMetrics
from server.store.db import storage_failure
from server.store.store import FutureRecord, Store, utcnow

logger = logging.getLogger(__name__)

CREATION_SEQ_ID = 0

# What a unit of work returns: the result payload and its content type.
Work = Callable[[], tuple[bytes, str]]


@dataclass
class _ModelQueue:
    """Requests of one training model waiting for their turn; None marks a refused (already failed) seq_id."""

    next_seq_id: int = 1
    waiting: dict[int, tuple[str, str, Work] | None] = field(default_factory=dict)
    """seq_id -> (request_id, request_type, work)."""
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
    def __init__(self, store: Store, sampling_workers: int = 1, *, seq_gap_timeout: float = 120.0,
                 metrics: ServerMetrics | None = None, hidden_paths: tuple[str, ...] = ()):
        self.store = store
        self.seq_gap_timeout = seq_gap_timeout
        self.metrics = metrics or ServerMetrics()
        self._hidden_paths = hidden_paths
        self._training = ThreadPoolExecutor(max_workers=1, thread_name_prefix="training")
        # One sampling thread for an engine that runs one request at a time; many for one that batches
        # whatever is in flight (vLLM), so each request completes when its own generation ends.
        self._sampling = ThreadPoolExecutor(max_workers=sampling_workers, thread_name_prefix="sampling")
        self._queues: dict[str, _ModelQueue] = {}
        self._waiters: dict[str, asyncio.Event] = {}
        self._dispatched: dict[str, concurrent.futures.Future] = {}
        self._unjournaled: dict[str, FutureRecord] = {}
        """Outcomes the journal could not take yet (a full disk), answered from memory meanwhile."""
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit_training(self, *, request_id: str, request_type: str, owner: str, model_id: str,
                              seq_id: int | None, payload_hash: str, work: Work) -> str:
        """Journal a training-side request and run it in its model's seq_id order; returns its request id.

        A model's creation (create_model or create-via-load) is journaled as seq_id 0, so a retried
        creation is deduplicated too, and runs at once; the SDK numbers the model's later requests
        from 1. A request without a seq_id also runs at once.
        """
        record = await self._journal(request_id, request_type, owner, model_id, seq_id, payload_hash)
        if record.request_id != request_id:
            return record.request_id
        if seq_id == CREATION_SEQ_ID:
            self._queues[model_id] = _ModelQueue()
        if seq_id is None or seq_id == CREATION_SEQ_ID:
            self._dispatch(self._training, request_id, request_type, work)
            return request_id
        queue = self._queues.get(model_id)
        if queue is None:
            # Not created since this server started, or its session was closed: it would wait forever.
            self._fail_now(request_id, NotFound(_not_loaded(model_id)))
            return request_id
        if seq_id < queue.next_seq_id:
            self._fail_now(request_id, InvalidRequest(
                f"seq_id {seq_id} of {model_id} comes after seq_id {queue.next_seq_id - 1} already ran (or was "
                f"skipped when it never arrived)"))
            return request_id
        queue.waiting[seq_id] = (request_id, request_type, work)
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

    async def submit_sampling(self, *, request_id: str, owner: str, sampling_session_id: str, seq_id: int | None,
                              payload_hash: str, work: Work) -> str:
        """Journal a sampling request (deduplicated on (sampling_session_id, seq_id)) and run it."""
        record = await self._journal(request_id, "Sample", owner, sampling_session_id, seq_id, payload_hash)
        if record.request_id == request_id:
            self._dispatch(self._sampling, request_id, "Sample", work)
        return record.request_id

    def retire_model(self, model_id: str, cleanup: Callable[[], None]) -> None:
        """Stop accepting a model's requests and run `cleanup` on the training thread after its queued work.

        Requests still waiting for an earlier seq_id fail now; later ones fail as not loaded.
        """
        queue = self._queues.pop(model_id, None)
        for entry in (queue.waiting.values() if queue else []):
            if entry is not None:
                self._fail_now(entry[0], NotFound(_not_loaded(model_id)))
        self.metrics.forget_run(model_id)
        if not self._closing:
            self._training.submit(cleanup)

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
                entry = queue.waiting.pop(seq_id)
                if entry is not None:
                    self._fail_now(entry[0], error)
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

    async def retrieve(self, request_id: str, timeout: float, *, owner: str) -> FutureRecord | None:
        """The owner's finished future, or None if it is still pending after waiting up to `timeout` seconds.

        Another tenant's request id is not found (404), exactly like an unknown one.
        """
        event = self._waiters.get(request_id)  # taken before reading, so a wake-up in between is not lost
        record = await self._read(request_id)
        if record.owner != owner:
            raise NotFound(f"no request {request_id}")
        if record.status != "pending":
            return record
        if event is None:
            return None
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return None
        return await self._read(request_id)

    def close(self, timeout: float = 30.0) -> ShutdownReport:
        """Accept no more work, fail what is queued, give running requests `timeout` seconds, fail the rest."""
        self._closing = True
        stopping = ShuttingDown("the server shut down before this request ran; send it again once it is back")
        never_dispatched = [entry[0] for model_id in list(self._queues)
                            for entry in self._queues.pop(model_id).waiting.values() if entry is not None]
        for request_id in never_dispatched:
            self._record(request_id, _failure(request_id, stopping))
        for executor in (self._training, self._sampling):
            executor.shutdown(wait=False, cancel_futures=True)
        dispatched = dict(self._dispatched)
        cancelled = [request_id for request_id, future in dispatched.items() if future.cancelled()]
        for request_id in cancelled:
            self._record(request_id, _failure(request_id, stopping))
        running = [future for future in dispatched.values() if not future.cancelled()]
        done, not_done = concurrent.futures.wait(running, timeout=timeout)
        interrupted = ShuttingDown(f"the server shut down while this request ran (it did not finish within "
                                   f"{timeout:g} s); its effect is lost: send it again once the server is back")
        for request_id, future in dispatched.items():
            if future in not_done:
                self._record(request_id, _failure(request_id, interrupted))
        self._flush_unjournaled()
        return ShutdownReport(finished=len(done), cancelled=len(never_dispatched) + len(cancelled),
                              interrupted=len(not_done))

    async def _read(self, request_id: str) -> FutureRecord:
        record = await asyncio.to_thread(self.store.get_future, request_id)
        if record is None:
            raise NotFound(f"no request {request_id}")
        kept = self._unjournaled.get(request_id)
        return record if kept is None else dataclasses.replace(kept, owner=record.owner)

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
        # One FIFO training thread: dispatch order is execution order.
        while queue.next_seq_id in queue.waiting:
            entry = queue.waiting.pop(queue.next_seq_id)
            del queue.arrived_at[queue.next_seq_id]
            queue.next_seq_id += 1
            if entry is not None:
                queue.in_flight += 1
                self._dispatch(self._training, *entry, model_id)
        self.metrics.set_queue_depth(model_id, len(queue.waiting) + queue.in_flight)

    def _dispatch(self, executor: ThreadPoolExecutor, request_id: str, request_type: str, work: Work,
                  model_id: str | None = None) -> None:
        self._dispatched[request_id] = executor.submit(self._run, request_id, request_type, work, model_id)

    def _run(self, request_id: str, request_type: str, work: Work, model_id: str | None) -> None:
        """Worker thread: run the work and record its result or error on the future."""
        started = time.perf_counter()
        try:
            payload, content_type = work()
            outcome = _success(request_id, payload, content_type)
        except TinkerServerError as error:
            outcome = _failure(request_id, error, self._hidden_paths)
        except OSError as error:
            failure = storage_failure(error, "finish this request")
            if not isinstance(failure, InsufficientStorage):
                logger.exception("event=request_failed request_id=%s", request_id)
            outcome = _failure(request_id, failure)
        except Exception as error:
            logger.exception("event=request_failed request_id=%s type=%s", request_id, type(error).__name__)
            outcome = _failure(request_id, TinkerServerError(
                f"internal error ({type(error).__name__}); the server log has the details under request {request_id}"))
        self.metrics.observe_request(request_type, outcome.status, time.perf_counter() - started)
        if outcome.status == "failed":
            logger.info("event=request_failed request_id=%s model_id=%s category=%s error=%r", request_id,
                        model_id, outcome.error_category, outcome.error)
        self._record(request_id, outcome)
        self._loop.call_soon_threadsafe(self._finished, request_id, model_id)

    def _journal_outcome(self, request_id: str, outcome: FutureRecord) -> None:
        if outcome.status == "complete":
            self.store.complete_future(request_id, result=outcome.result, content_type=outcome.content_type)
        else:
            self.store.fail_future(request_id, error=outcome.error, category=outcome.error_category)

    def _record(self, request_id: str, outcome: FutureRecord) -> None:
        """Journal a finished future's outcome; if the journal cannot take it, keep it in memory."""
        try:
            self._journal_outcome(request_id, outcome)
        except Exception:
            logger.warning("event=journal_write_failed request_id=%s: the outcome is kept in memory until the "
                           "journal can take it", request_id, exc_info=True)
            self._unjournaled[request_id] = outcome
            self.metrics.unjournaled.set(len(self._unjournaled))

    def _flush_unjournaled(self) -> None:
        for request_id, outcome in list(self._unjournaled.items()):
            try:
                self._journal_outcome(request_id, outcome)
            except Exception:
                return  # still full: try again on the next round
            del self._unjournaled[request_id]
        self.metrics.unjournaled.set(len(self._unjournaled))

    def _fail_now(self, request_id: str, error: TinkerServerError) -> None:
        """Fail a journaled future that will never run (refused, unloaded, or behind a gap)."""
        self._record(request_id, _failure(request_id, error, self._hidden_paths))
        self._finished(request_id, None)

    def _finished(self, request_id: str, model_id: str | None) -> None:
        self._dispatched.pop(request_id, None)
        event = self._waiters.pop(request_id, None)
        if event is not None:
            event.set()
        queue = self._queues.get(model_id) if model_id is not None else None
        if queue is not None:
            queue.in_flight -= 1
            queue.idle_since = time.monotonic()
            self.metrics.set_queue_depth(model_id, len(queue.waiting) + queue.in_flight)


def _success(request_id: str, payload: bytes, content_type: str) -> FutureRecord:
    return FutureRecord(request_id=request_id, request_type="", owner=None, model_id=None, seq_id=None, payload_hash="",
                        status="complete", result=payload, content_type=content_type, error=None,
                        error_category=None, created_at=utcnow(), finished_at=utcnow())


def _failure(request_id: str, error: TinkerServerError, hidden_paths: tuple[str, ...] = ()) -> FutureRecord:
    return FutureRecord(request_id=request_id, request_type="", owner=None, model_id=None, seq_id=None, payload_hash="",
                        status="failed", result=None, content_type=None,
                        error=without_server_paths(str(error), *hidden_paths), error_category=error.category,
                        created_at=utcnow(), finished_at=utcnow())
