"""Sampling admission: requests from acceptance to retrieval, in memory, bounded, handed to the engine
without a thread.

Sampling is RL's hot path (one short request per episode per turn, thousands a second), so nothing
here touches the journal or holds a thread; what must be kept, and its bounds, is `SamplingFutures`'.
Training order is elsewhere (ordering.py). Knows nothing about HTTP, rendering or the journal.
"""

import asyncio
import concurrent.futures
import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from server.errors import Conflict, Gone, Overloaded, ShuttingDown
from server.metrics import ServerMetrics
from server.sampling.types import SampleOutput, SamplingEngine, SamplingRequest
from server.scheduler.outcomes import Outcome, failure_of

REQUEST_ID_PREFIX = "sample-"
"""Sampling request ids start with this, so retrieve_future knows where to look."""

Respond = Callable[[SampleOutput], tuple[bytes, str]]
"""Turns the engine's output into the future's payload and content type (and records what the route records
with it)."""


def is_sampling_request_id(request_id: str) -> bool:
    return request_id.startswith(REQUEST_ID_PREFIX)


@dataclass(eq=False)
class _Future:
    owner: str
    key: tuple[str, int] | None
    """(sampling session, seq_id), when the client numbered the request."""
    payload_hash: str
    started: float
    release: Callable[[], None] | None = None
    """Lets go of what the request holds (its checkpoint's pin), once its outcome is made."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    engine_future: concurrent.futures.Future | None = None


class SamplingFutures:
    """The sampling requests of one server, from `submit` to `retrieve`; event-loop only (but `close`).

    A request goes to the engine with `submit` (the engine batches whatever is in flight), its result is
    turned into the future's payload when the engine is done, and its waiter is woken in memory. Kept,
    bounded:
    - each pending or unretrieved request's (sampling session, seq_id), so that a resent request gets the
      original request id and never samples twice (a Conflict if its payload differs);
    - outcomes until they are retrieved, at most `keep_seconds` and `max_kept_bytes` of them (the oldest
      go first);
    - at most `max_pending` requests in the engine: more get a 429, which the SDK takes as backpressure
      (it waits, then sends the same seq_id again).
    A sampling request id this server does not know (a restart lost it, it was forgotten, or it is another
    tenant's) answers 410, on which the SDK sends the sample again: a kill -9 loses at most the sampling
    requests in flight, never a result a client holds.
    """

    def __init__(self, engine: SamplingEngine, metrics: ServerMetrics, *, max_pending: int = 4096,
                 max_kept_bytes: int = 1 << 30, keep_seconds: float = 600.0, hidden_paths: tuple[str, ...] = ()):
        self.engine = engine
        self.metrics = metrics
        self.max_pending = max_pending
        self.max_kept_bytes = max_kept_bytes
        self.keep_seconds = keep_seconds
        self._hidden_paths = hidden_paths
        self._futures: dict[str, _Future] = {}
        self._by_key: dict[tuple[str, int], str] = {}
        self._unretrieved: OrderedDict[str, float] = OrderedDict()
        """Request id -> when it finished, of the outcomes not retrieved yet, oldest first."""
        self._kept_bytes = 0
        self._num_pending = 0
        self._pending_by_owner: dict[str, int] = {}
        self._closing = False
        self._responding: set[asyncio.Task] = set()
        """Responses being made on worker threads (kept referenced until done)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        # Request ids: this process's own random prefix and a count (uuid4 reads the system's randomness, a system
        # call that also lets other threads take the interpreter lock, on every request).
        self._id_prefix = f"{REQUEST_ID_PREFIX}{secrets.token_hex(8)}-"
        self._ids = itertools.count()

    def submit(self, *, owner: str, sampling_session_id: str, seq_id: int | None, payload_hash: str,
               request: SamplingRequest, respond: Respond, respond_in_thread: bool = False,
               release: Callable[[], None] | None = None) -> str:
        """Hand a request to the engine and return its request id (the original one for a resent seq_id).

        Args:
            release: called once the request is over, whether it ran, failed or was refused here.
            respond_in_thread: `respond` writes to the journal or encodes a large payload (prompt logprobs):
                it runs on a worker thread instead of the event loop, where a short sample's few tokens
                are encoded.
        """
        try:
            key = None if seq_id is None else (sampling_session_id, seq_id)
            if key is not None and (known := self._by_key.get(key)) is not None:
                if self._futures[known].payload_hash != payload_hash:
                    raise Conflict(f"seq_id {seq_id} of {sampling_session_id} was already used by a different "
                                   f"sample request")
                if release is not None:
                    release()
                return known
            if self._closing:
                raise ShuttingDown("the server is shutting down; send the request again once it is back")
            if self._num_pending >= self.max_pending:
                raise Overloaded(f"{self._num_pending} sampling requests are in flight, this server's limit; the "
                                 f"SDK sends this one again shortly")
            engine_future = self.engine.submit(request)
        except BaseException:
            if release is not None:
                release()
            raise
        self._loop = self._loop or asyncio.get_running_loop()
        request_id = f"{self._id_prefix}{next(self._ids)}"
        future = _Future(owner, key, payload_hash, time.perf_counter(), release)
        future.engine_future = engine_future
        self._futures[request_id] = future
        if key is not None:
            self._by_key[key] = request_id
        self._num_pending += 1
        self._pending_by_owner[owner] = self._pending_by_owner.get(owner, 0) + 1
        future.engine_future.add_done_callback(lambda done: self._loop.call_soon_threadsafe(
            self._engine_done, request_id, done, respond, respond_in_thread))
        return request_id

    async def retrieve(self, request_id: str, timeout: float, *, owner: str) -> Outcome | None:
        """The owner's outcome (then forgotten), or None if still running after `timeout` seconds; 410 when unknown."""
        future = self._futures.get(request_id)
        if future is None or future.owner != owner:
            raise Gone(f"sampling request {request_id} is not known here (the server restarted, or its result was "
                       f"retrieved or kept past {self.keep_seconds:g} s); send the sample again")
        if future.outcome is None:
            try:
                async with asyncio.timeout(timeout):
                    await future.done.wait()
            except TimeoutError:
                return None
        if self._futures.pop(request_id, None) is not None:
            self._forget(request_id, future)
        return future.outcome

    def close(self, timeout: float) -> tuple[int, int]:
        """Accept no more requests and give those in the engine `timeout` seconds; (finished, unfinished)."""
        self._closing = True
        running = [future.engine_future for future in self._futures.values() if future.outcome is None]
        finished, unfinished = concurrent.futures.wait(running, timeout=timeout)
        return len(finished), len(unfinished)

    def _engine_done(self, request_id: str, done: concurrent.futures.Future, respond: Respond,
                     respond_in_thread: bool) -> None:
        """Event loop: the engine is through with a request; have `respond` make its outcome."""
        try:
            output = done.result()
        except concurrent.futures.CancelledError:
            self._finish(request_id, Outcome.failure(ShuttingDown("the server shut down before this request ran; "
                                                                  "send it again once it is back")))
            return
        except Exception as error:
            self._finish(request_id, failure_of(error, request_id, self._hidden_paths))
            return
        if respond_in_thread:
            task = asyncio.create_task(self._respond_in_thread(request_id, output, respond))
            self._responding.add(task)
            task.add_done_callback(self._responding.discard)
            return
        try:
            outcome = Outcome.success(*respond(output))
        except Exception as error:
            outcome = failure_of(error, request_id, self._hidden_paths)
        self._finish(request_id, outcome)

    async def _respond_in_thread(self, request_id: str, output: SampleOutput, respond: Respond) -> None:
        try:
            outcome = Outcome.success(*await asyncio.to_thread(respond, output))
        except Exception as error:
            outcome = failure_of(error, request_id, self._hidden_paths)
        self._finish(request_id, outcome)

    def _finish(self, request_id: str, outcome: Outcome) -> None:
        """Record a request's outcome and wake its waiter."""
        future = self._futures.get(request_id)
        if future is None:  # forgotten meanwhile (shutdown)
            return
        self.metrics.observe_request("Sample", outcome.status, time.perf_counter() - future.started)
        if future.release is not None:
            future.release()
        future.outcome = outcome
        self._done_pending(future.owner)
        self._kept_bytes += len(outcome.result or b"")
        now = time.monotonic()
        self._unretrieved[request_id] = now
        future.done.set()
        # Outcomes nobody came for (their client went away): the oldest go past the time or byte budget.
        while self._unretrieved:
            oldest, finished_at = next(iter(self._unretrieved.items()))
            if now - finished_at < self.keep_seconds and self._kept_bytes <= self.max_kept_bytes:
                break
            self._forget(oldest, self._futures.pop(oldest))

    def pending_of(self, owner: str) -> int:
        """The tenant's sampling requests in the engine now."""
        return self._pending_by_owner.get(owner, 0)

    def _done_pending(self, owner: str) -> None:
        self._num_pending -= 1
        left = self._pending_by_owner.pop(owner) - 1
        if left:
            self._pending_by_owner[owner] = left

    def _forget(self, request_id: str, future: _Future) -> None:
        """Let go of a future taken out of `_futures`: its seq_id, and its outcome or its pending count."""
        if future.key is not None:
            self._by_key.pop(future.key, None)
        if future.outcome is None:
            self._done_pending(future.owner)
        else:
            self._unretrieved.pop(request_id, None)
            self._kept_bytes -= len(future.outcome.result or b"")
