"""The training loop: the one thread that runs each planned cycle through the executor, and the two
that record outcomes behind it.

Each cycle is planned by `plan_cycle` (passes.py) from the runs' ready queues, run on the training
thread, and its outcomes handed off in the order the operations ran: the finisher records each result
(and what its route records with it) while the next cycle computes, and the checkpoint writer writes a
save's host copy first. Knows nothing about seq_ids, the event loop or where outcomes are kept: it is
given a `record` for outcomes and an `on_finished` to call (from its threads) once one is recorded.
"""

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from server.errors import ShuttingDown
from server.metrics import ServerMetrics
from server.scheduler.outcomes import Outcome, failure_of
from server.scheduler.passes import Cycle, PassShare, plan_cycle
from server.scheduler.requests import TrainingRequest
from server.training.executor import TrainingExecutor
from server.training.operations import SaveState

logger = logging.getLogger(__name__)

# Saves copied but not yet written: a client saving faster than the disk takes holds the training
# thread here, so that host copies never pile up.
MAX_PENDING_WRITES = 2
# Outcomes handed to the finisher and not yet recorded: a journal slower than training holds the
# training thread here, so that results never pile up in memory.
MAX_PENDING_FINISHES = 64


class TrainingLoop:
    def __init__(self, executor: TrainingExecutor, metrics: ServerMetrics, *, record: Callable[[str, Outcome], None],
                 on_finished: Callable[[str, str | None], None], pass_tokens: int, pass_runs: int | None,
                 hidden_paths: tuple[str, ...]):
        """
        Args:
            record: records a request's outcome (called from the loop's threads).
            on_finished: called with (request_id, model_id of a sequenced request or None) once recorded.
        """
        self.executor = executor
        self.metrics = metrics
        self.pass_tokens = pass_tokens
        self.pass_runs = pass_runs
        self._record = record
        self._on_finished = on_finished
        self._hidden_paths = hidden_paths
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._write_slots = threading.Semaphore(MAX_PENDING_WRITES)
        # A step's results take several database commits (the future, the run's metrics): on the
        # training thread they would leave the accelerator idle between cycles.
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="finisher")
        self._finish_slots = threading.Semaphore(MAX_PENDING_FINISHES)
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
        self._training = threading.Thread(target=self._train, name="training", daemon=True)
        self._training.start()

    def make_ready(self, request: TrainingRequest) -> None:
        """Queue a request whose turn came behind its run's ready ones."""
        with self._lock:
            self._ready.setdefault(request.model_id, deque()).append(request)
            self._lock.notify_all()

    def stop(self) -> tuple[list[TrainingRequest], list[str]]:
        """Run no more cycles; the ready requests that will not run, and the ids of those running now."""
        with self._lock:
            self._stopping = True
            queued = [request for lane in self._ready.values() for request in lane if request.request_id is not None]
            self._ready.clear()
            running = list(self._running)
            self._lock.notify_all()
        return queued, running

    def abandon(self, running: list[str], timeout: float) -> list[str]:
        """Give `running` up to `timeout` seconds to finish; those that did not are abandoned (their
        outcome is the caller's to record), and the finisher and writer take nothing more."""
        with self._lock:
            self._lock.wait_for(lambda: not self._running.keys() & set(running), timeout)
        with self._finishing, self._lock:
            unfinished = [request_id for request_id in running if request_id in self._running]
            self._abandoned.update(unfinished)
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._finisher.shutdown(wait=False, cancel_futures=True)
        return unfinished

    def _train(self) -> None:
        """Run cycles until stopped: each run's next operation that is not a forward_backward, then one pass."""
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stopping or any(self._ready.values()))
                if self._stopping:
                    return
                cycle = self._take_cycle()
                for request in [*cycle.alone, *(share.request for share in cycle.passing)]:
                    if request.request_id is not None:
                        self._running[request.request_id] = request
            for request in cycle.alone:
                request.started = time.perf_counter()
                self._run_alone(request)
            if cycle.passing:
                started = time.perf_counter()
                for share in cycle.passing:  # a request's work: from its first pass to its result
                    share.request.started = share.request.started or started
                self._run_pass(cycle.passing)

    def _take_cycle(self) -> Cycle:
        """Plan the next cycle and take its requests off the ready queues (under _lock)."""
        for model_id in [model_id for model_id, lane in self._ready.items() if not lane]:
            del self._ready[model_id]
            self._last_served.pop(model_id, None)
        cycle = plan_cycle(self._ready, self._last_served, self.pass_tokens, self.pass_runs)
        for request in [*cycle.alone, *(share.request for share in cycle.passing)]:
            taken = self._ready[request.model_id].popleft()
            assert taken is request, "a cycle takes requests from the front of their run's queue"
        if cycle.passing:
            self._passes += 1
            for model_id in cycle.served:
                self._last_served[model_id] = self._passes
        return cycle

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

    def _run_pass(self, passing: list[PassShare]) -> None:
        """One forward/backward over a slice of each request's datums; a request whose last datum ran finishes."""
        pieces = [dataclasses.replace(share.request.operation, examples=share.request.operation.examples[
            share.request.done:share.request.done + share.num_datums]) for share in passing]
        self.metrics.observe_pass(len({share.request.model_id for share in passing}),
                                  sum(len(e.input_ids) for piece in pieces for e in piece.examples))
        outcomes = self.executor.run_pass(pieces)
        unfinished = []
        for share, outcome in zip(passing, outcomes):
            request = share.request
            if isinstance(outcome, Exception):
                self._finish_later(request, error=outcome)
                continue
            if request.result is None:
                request.result = outcome
            else:
                request.result.extend(outcome)
            request.done += share.num_datums
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
        self._on_finished(request_id, request.model_id if request.sequenced else None)
