"""The scheduler's front: training requests in (journaled, deduplicated, ordered), outcomes out.

Every submitted request is journaled as a future before it is acknowledged (outcomes.py); a retry
with a (model_id, seq_id) already journaled gets the original request id and never runs twice. A
run's requests then wait for their seq_id's turn (ordering.py), and ready ones are run by the
training loop (loop.py) in cycles that passes.py plans. Waiters are woken in memory; the database is
only the journal. Sampling never comes here: its admission and futures live in memory (sampling.py).
"""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from server.errors import NotFound, ShuttingDown, TinkerServerError
from server.metrics import ServerMetrics
from server.scheduler.loop import TrainingLoop
from server.scheduler.ordering import CREATION_SEQ_ID, RunOrder, not_loaded
from server.scheduler.outcomes import Outcome, TrainingFutures
from server.scheduler.requests import Respond, TrainingRequest
from server.store.store import Store
from server.training.executor import TrainingExecutor
from server.training.operations import Operation, Unload

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShutdownReport:
    """What `Scheduler.close` did with the work it still had."""

    finished: int
    """Running requests that ended within the timeout."""
    cancelled: int
    """Queued requests failed without running."""
    interrupted: int
    """Running requests failed because they outlived the timeout (their threads are abandoned)."""


class Scheduler:
    def __init__(self, store: Store, executor: TrainingExecutor, *, pass_tokens: int = 65536,
                 pass_runs: int | None = None, seq_gap_timeout: float = 120.0, metrics: ServerMetrics | None = None,
                 hidden_paths: tuple[str, ...] = ()):
        """
        Args:
            pass_tokens: the token budget of one forward_backward pass, shared among the runs with work.
            pass_runs: at most this many runs in one pass (None: no limit; 1: one run at a time, in turn).
        """
        self.executor = executor
        self.seq_gap_timeout = seq_gap_timeout
        self.metrics = metrics or ServerMetrics()
        self._hidden_paths = hidden_paths
        self.futures = TrainingFutures(store, self.metrics)
        self._order = RunOrder(self.metrics)
        """Event loop only."""
        self._loop = TrainingLoop(executor, self.metrics, record=self.futures.record,
                                  on_finished=self._finished_from_thread, pass_tokens=pass_tokens,
                                  pass_runs=pass_runs, hidden_paths=hidden_paths)
        self._closing = False
        self._event_loop: asyncio.AbstractEventLoop | None = None

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
            self._order.open(model_id)
        if seq_id is None or seq_id == CREATION_SEQ_ID:
            self._loop.make_ready(request)
            return request_id
        try:
            ready = self._order.accept(request, seq_id)
        except TinkerServerError as error:
            self._fail_unrun(request, error)
            return request_id
        for request in ready:
            self._loop.make_ready(request)
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
        for request in self._order.refuse(model_id, seq_id):
            self._loop.make_ready(request)
        return request_id

    def retire_model(self, model_id: str, then: Callable[[], None]) -> None:
        """Stop accepting a model's requests and unload it after its ready requests, then call `then`
        (on the training thread).

        Requests still waiting for an earlier seq_id fail now; later ones fail as not loaded.
        """
        for request in self._order.retire(model_id):
            self._fail_unrun(request, NotFound(not_loaded(model_id)))
        self.metrics.forget_run(model_id)
        if not self._closing:
            self._loop.make_ready(TrainingRequest(None, "Unload", model_id, Unload(model_id), lambda _: then()))

    def fail_stalled_gaps(self, now: float | None = None) -> list[tuple[str, int]]:
        """Fail the requests queued behind a seq_id that has not arrived within the gap timeout
        (ordering.py says from when); returns the (model_id, missing seq_id) pairs it gave up on."""
        now = time.monotonic() if now is None else now
        given_up = self._order.stalled_gaps(now, self.seq_gap_timeout)
        for gap in given_up:
            for request in gap.requests:
                self._fail_unrun(request, gap.error)
        return [(gap.model_id, gap.missing_seq_id) for gap in given_up]

    async def watch(self, interval: float) -> None:
        """Housekeeping every `interval` seconds: close stalled gaps, journal outcomes kept in memory."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.fail_stalled_gaps()
                if self.futures.num_unjournaled:
                    await asyncio.to_thread(self.futures.flush_unjournaled)
            except Exception:  # a database hiccup must not end the loop: the next round tries again
                logger.exception("scheduler housekeeping failed")

    async def retrieve(self, request_id: str, timeout: float, *, owner: str) -> Outcome | None:
        """The owner's finished request, or None if still pending after `timeout` seconds (TrainingFutures)."""
        return await self.futures.retrieve(request_id, timeout, owner=owner)

    @property
    def num_unjournaled(self) -> int:
        """Outcomes held in memory because the journal could not take them (its disk is full)."""
        return self.futures.num_unjournaled

    def close(self, timeout: float = 30.0, cause: str | None = None) -> ShutdownReport:
        """Accept no more work, fail what is queued, give running requests `timeout` seconds, fail the rest.

        Args:
            cause: why the server stops, when it is not asked to (it opens each failed request's message).
        """
        self._closing = True
        why = f"{cause}: " if cause else ""
        stopping = ShuttingDown(f"{why}the server shut down before this request ran; send it again once it is back")
        queued = self._order.drain()
        ready, running = self._loop.stop()
        queued += ready
        for request in queued:
            self.futures.record(request.request_id, Outcome.failure(stopping))
            if request.release is not None:
                request.release()
        unfinished = self._loop.abandon(running, timeout)
        interrupted = ShuttingDown(f"{why}the server shut down while this request ran (it did not finish within "
                                   f"{timeout:g} s); its effect is lost: send it again once the server is back")
        for request_id in unfinished:
            self.futures.record(request_id, Outcome.failure(interrupted))
        self.futures.flush_unjournaled()
        return ShutdownReport(finished=len(running) - len(unfinished), cancelled=len(queued),
                              interrupted=len(unfinished))

    async def _journal(self, request_id: str, request_type: str, owner: str, model_id: str, seq_id: int | None,
                       payload_hash: str):
        if self._closing:
            raise ShuttingDown("the server is shutting down; send the request again once it is back")
        self._event_loop = asyncio.get_running_loop()
        return await self.futures.journal(request_id, request_type, owner, model_id, seq_id, payload_hash)

    def _fail_unrun(self, request: TrainingRequest, error: TinkerServerError) -> None:
        """Fail a request that will never run (unloaded, or behind a gap) and let go of what it holds."""
        self._fail_now(request.request_id, error)
        if request.release is not None:
            request.release()

    def _fail_now(self, request_id: str, error: TinkerServerError) -> None:
        """Fail a journaled future that will never run (refused, unloaded, or behind a gap)."""
        self.futures.record(request_id, Outcome.failure(error, self._hidden_paths))
        self._finished(request_id, None)

    def _finished_from_thread(self, request_id: str, model_id: str | None) -> None:
        self._event_loop.call_soon_threadsafe(self._finished, request_id, model_id)

    def _finished(self, request_id: str, model_id: str | None) -> None:
        self.futures.wake(request_id)
        if model_id is not None:
            self._order.finished(model_id)
