"""Futures, per-model seq_id ordering, retry deduplication and the worker threads.

Every submitted request is journaled as a future before it is acknowledged. A model's training
requests run strictly in seq_id order (the SDK sends a forward_backward's chunks concurrently,
the first one last); a retry with a (model_id, seq_id) already journaled gets the original
request id and never runs twice. Training has one worker thread and sampling its own (several when
the engine batches concurrent requests), so sampling never waits behind training. Waiters are woken
in memory; the database is only the journal.
"""

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from server.errors import Conflict, InvalidRequest, NotFound, TinkerServerError
from server.store.store import FutureRecord, Store

logger = logging.getLogger(__name__)

CREATION_SEQ_ID = 0

# What a unit of work returns: the result payload and its content type.
Work = Callable[[], tuple[bytes, str]]


@dataclass
class _ModelQueue:
    """Requests of one training model waiting for their turn."""

    next_seq_id: int = 1
    waiting: dict[int, tuple[str, Work]] = field(default_factory=dict)


def _not_loaded(model_id: str) -> str:
    return (f"model {model_id} is not loaded on this server (its session was closed or the server restarted); "
            f"create it again from a checkpoint with create_training_client_from_state")


class Scheduler:
    def __init__(self, store: Store, sampling_workers: int = 1):
        self.store = store
        self._training = ThreadPoolExecutor(max_workers=1, thread_name_prefix="training")
        # One sampling thread for an engine that runs one request at a time; many for one that batches
        # whatever is in flight (vLLM), so each request completes when its own generation ends.
        self._sampling = ThreadPoolExecutor(max_workers=sampling_workers, thread_name_prefix="sampling")
        self._queues: dict[str, _ModelQueue] = {}
        self._waiters: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def close(self) -> None:
        self._training.shutdown(wait=True, cancel_futures=True)
        self._sampling.shutdown(wait=True, cancel_futures=True)

    async def submit_training(self, *, request_id: str, request_type: str, model_id: str, seq_id: int | None,
                              payload_hash: str, work: Work) -> str:
        """Journal a training-side request and run it in its model's seq_id order; returns its request id.

        A model's creation (create_model or create-via-load) is journaled as seq_id 0, so a retried
        creation is deduplicated too, and runs at once; the SDK numbers the model's later requests
        from 1. A request without a seq_id also runs at once.
        """
        record = await self._journal(request_id, request_type, model_id, seq_id, payload_hash)
        if record.request_id != request_id:
            return record.request_id
        if seq_id == CREATION_SEQ_ID:
            self._queues[model_id] = _ModelQueue()
        if seq_id is None or seq_id == CREATION_SEQ_ID:
            self._dispatch(self._training, request_id, work)
            return request_id
        queue = self._queues.get(model_id)
        if queue is None:
            # Not created since this server started, or its session was closed: it would wait forever.
            self._fail_now(request_id, NotFound(_not_loaded(model_id)))
            return request_id
        if seq_id < queue.next_seq_id:
            self._fail_now(request_id, InvalidRequest(
                f"seq_id {seq_id} of {model_id} comes after seq_id {queue.next_seq_id - 1} already ran"))
            return request_id
        queue.waiting[seq_id] = (request_id, work)
        while queue.next_seq_id in queue.waiting:
            ready_id, ready_work = queue.waiting.pop(queue.next_seq_id)
            queue.next_seq_id += 1
            # One FIFO training thread: dispatch order is execution order.
            self._dispatch(self._training, ready_id, ready_work)
        return request_id

    async def submit_sampling(self, *, request_id: str, sampling_session_id: str, seq_id: int, payload_hash: str,
                              work: Work) -> str:
        """Journal a sampling request (deduplicated on (sampling_session_id, seq_id)) and run it."""
        record = await self._journal(request_id, "Sample", sampling_session_id, seq_id, payload_hash)
        if record.request_id == request_id:
            self._dispatch(self._sampling, request_id, work)
        return record.request_id

    def retire_model(self, model_id: str, cleanup: Callable[[], None]) -> None:
        """Stop accepting a model's requests and run `cleanup` on the training thread after its queued work.

        Requests still waiting for an earlier seq_id fail now; later ones fail as not loaded.
        """
        queue = self._queues.pop(model_id, None)
        for request_id, _ in (queue.waiting.values() if queue else []):
            self._fail_now(request_id, NotFound(_not_loaded(model_id)))
        self._training.submit(cleanup)

    async def retrieve(self, request_id: str, timeout: float) -> FutureRecord | None:
        """The finished future, or None if it is still pending after waiting up to `timeout` seconds."""
        event = self._waiters.get(request_id)  # taken before reading, so a wake-up in between is not lost
        record = await asyncio.to_thread(self.store.get_future, request_id)
        if record is None:
            raise NotFound(f"no request {request_id}")
        if record.status != "pending":
            return record
        if event is None:
            return None
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return None
        return await asyncio.to_thread(self.store.get_future, request_id)

    async def _journal(self, request_id: str, request_type: str, model_id: str, seq_id: int | None,
                       payload_hash: str) -> FutureRecord:
        self._loop = asyncio.get_running_loop()
        record = await asyncio.to_thread(self.store.insert_future, request_id=request_id, request_type=request_type,
                                         model_id=model_id, seq_id=seq_id, payload_hash=payload_hash)
        if record.request_id != request_id and (record.payload_hash != payload_hash
                                                or record.request_type != request_type):
            raise Conflict(f"seq_id {seq_id} of {model_id} was already used by a different {record.request_type} "
                           f"request")
        if record.request_id == request_id:
            self._waiters[request_id] = asyncio.Event()
        return record

    def _dispatch(self, executor: ThreadPoolExecutor, request_id: str, work: Work) -> None:
        executor.submit(self._run, request_id, work)

    def _run(self, request_id: str, work: Work) -> None:
        """Worker thread: run the work and record its result or error on the future."""
        try:
            payload, content_type = work()
            self.store.complete_future(request_id, result=payload, content_type=content_type)
        except TinkerServerError as error:
            self.store.fail_future(request_id, error=str(error), category=error.category)
        except Exception as error:
            logger.exception("request %s failed", request_id)
            self.store.fail_future(request_id, error=f"internal error: {type(error).__name__}: {error}",
                                   category="server")
        finally:
            self._loop.call_soon_threadsafe(self._wake, request_id)

    def _fail_now(self, request_id: str, error: TinkerServerError) -> None:
        def work() -> tuple[bytes, str]:
            raise error

        self._dispatch(self._training, request_id, work)

    def _wake(self, request_id: str) -> None:
        event = self._waiters.pop(request_id, None)
        if event is not None:
            event.set()
