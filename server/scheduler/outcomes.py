"""What a finished request answers (`Outcome`), how an error becomes one, and where training outcomes are kept.

Both kinds of futures end in an Outcome: training ones are journaled here (`TrainingFutures`: the
future's row before it is acknowledged, its outcome once recorded, in-memory waiters woken, and a
full disk's outcomes kept in memory until the journal takes them); sampling ones live in memory
(sampling.py). `retrieve_future` turns an Outcome into the response. Knows nothing about how
requests run or in which order.
"""

import asyncio
import logging
from dataclasses import dataclass

from server.errors import Conflict, InsufficientStorage, NotFound, TinkerServerError, without_server_paths
from server.metrics import ServerMetrics
from server.store.db import storage_failure
from server.store.store import FutureRecord, Store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """A finished request: its payload and content type, or why it failed."""

    status: str
    """complete or failed."""
    result: bytes | None = None
    content_type: str | None = None
    error: str | None = None
    error_category: str | None = None

    @classmethod
    def success(cls, result: bytes, content_type: str) -> "Outcome":
        return cls("complete", result=result, content_type=content_type)

    @classmethod
    def failure(cls, error: TinkerServerError, hidden_paths: tuple[str, ...] = ()) -> "Outcome":
        return cls("failed", error=without_server_paths(str(error), *hidden_paths), error_category=error.category)


def failure_of(error: Exception, request_id: str, hidden_paths: tuple[str, ...] = (),
               model_id: str | None = None) -> Outcome:
    """The failed outcome for an error a request's work raised (an unexpected one is logged in full)."""
    if isinstance(error, TinkerServerError):
        failure = error
    elif isinstance(error, OSError):
        failure = storage_failure(error, "finish this request")
        if not isinstance(failure, InsufficientStorage):
            logger.error("event=request_failed request_id=%s", request_id, exc_info=error)
    else:
        logger.error("event=request_failed request_id=%s type=%s", request_id, type(error).__name__, exc_info=error)
        failure = TinkerServerError(f"internal error ({type(error).__name__}); the server log has the details "
                                    f"under request {request_id}")
    logger.info("event=request_failed request_id=%s model_id=%s category=%s error=%r", request_id, model_id,
                failure.category, str(failure))
    return Outcome.failure(failure, hidden_paths)


class TrainingFutures:
    """The journal of training futures, and their waiters (event loop) and recorders (any thread)."""

    def __init__(self, store: Store, metrics: ServerMetrics):
        self.store = store
        self.metrics = metrics
        self._waiters: dict[str, asyncio.Event] = {}
        self._unjournaled: dict[str, Outcome] = {}
        """Outcomes the journal could not take yet (a full disk), answered from memory meanwhile."""

    async def journal(self, request_id: str, request_type: str, owner: str, model_id: str, seq_id: int | None,
                      payload_hash: str) -> FutureRecord:
        """Journal a pending future; a retry of a journaled (model_id, seq_id) gets the original's record.

        Raises Conflict when the slot holds a different request.
        """
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

    def record(self, request_id: str, outcome: Outcome) -> None:
        """Journal a finished future's outcome; if the journal cannot take it, keep it in memory."""
        try:
            self._journal_outcome(request_id, outcome)
        except Exception:
            logger.warning("event=journal_write_failed request_id=%s: the outcome is kept in memory until the "
                           "journal can take it", request_id, exc_info=True)
            self._unjournaled[request_id] = outcome
            self.metrics.unjournaled.set(len(self._unjournaled))

    def wake(self, request_id: str) -> None:
        """Event loop: the request's outcome is recorded; whoever waits for it reads it now."""
        event = self._waiters.pop(request_id, None)
        if event is not None:
            event.set()

    @property
    def num_unjournaled(self) -> int:
        """Outcomes held in memory because the journal could not take them (its disk is full)."""
        return len(self._unjournaled)

    def flush_unjournaled(self) -> None:
        """Journal the outcomes kept in memory, as many as the journal takes now."""
        for request_id, outcome in list(self._unjournaled.items()):
            try:
                self._journal_outcome(request_id, outcome)
            except Exception:
                return  # still full: try again on the next round
            del self._unjournaled[request_id]
        self.metrics.unjournaled.set(len(self._unjournaled))

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

    def _journal_outcome(self, request_id: str, outcome: Outcome) -> None:
        if outcome.status == "complete":
            self.store.complete_future(request_id, result=outcome.result, content_type=outcome.content_type)
        else:
            self.store.fail_future(request_id, error=outcome.error, category=outcome.error_category)
