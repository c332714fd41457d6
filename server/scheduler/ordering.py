"""Per-run seq_id order: which of a run's training requests may run now, refusals, gaps, retirement.

A run's requests become ready strictly in seq_id order (the SDK sends a forward_backward's chunks
concurrently, the first one last). A refused request still takes its seq_id, and a seq_id that never
arrives fails the requests queued behind it after a bounded wait, so one bad call never wedges a run.
Event loop only; knows nothing about the journal, threads or how requests run.
"""

import logging
import time
from dataclasses import dataclass, field

from server.errors import InvalidRequest, NotFound
from server.metrics import ServerMetrics
from server.scheduler.requests import TrainingRequest

logger = logging.getLogger(__name__)

CREATION_SEQ_ID = 0


@dataclass
class RunQueue:
    """Requests of one training run waiting for their turn; None marks a refused (already failed) seq_id."""

    next_seq_id: int = 1
    waiting: dict[int, TrainingRequest | None] = field(default_factory=dict)
    arrived_at: dict[int, float] = field(default_factory=dict)
    in_flight: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    """When the run's last dispatched request finished: a gap is timed from here."""


@dataclass(frozen=True)
class GaveUp:
    """A seq_id that never arrived: the requests queued behind it fail with `error`."""

    model_id: str
    missing_seq_id: int
    requests: list[TrainingRequest]
    error: InvalidRequest


def not_loaded(model_id: str) -> str:
    return (f"model {model_id} is not loaded on this server (its session was closed or the server restarted); "
            f"create it again from a checkpoint with create_training_client_from_state")


class RunOrder:
    """Each run's seq_id queue. Methods return the requests whose turn came; failing them is the caller's."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self._queues: dict[str, RunQueue] = {}

    def open(self, model_id: str) -> None:
        """A run was created (seq_id 0): its requests are accepted from seq_id 1 on."""
        self._queues[model_id] = RunQueue()

    def accept(self, request: TrainingRequest, seq_id: int) -> list[TrainingRequest]:
        """Queue a request in its run's order; the requests now ready, in order.

        Raises NotFound for a run not loaded here and InvalidRequest for a seq_id whose turn has passed.
        """
        queue = self._queues.get(request.model_id)
        if queue is None:
            # Not created since this server started, or its session was closed: it would wait forever.
            raise NotFound(not_loaded(request.model_id))
        if seq_id < queue.next_seq_id:
            raise InvalidRequest(f"seq_id {seq_id} of {request.model_id} comes after seq_id {queue.next_seq_id - 1} "
                                 f"already ran (or was skipped when it never arrived)")
        queue.waiting[seq_id] = request
        queue.arrived_at[seq_id] = time.monotonic()
        return self._advance(request.model_id, queue)

    def refuse(self, model_id: str, seq_id: int) -> list[TrainingRequest]:
        """A refused request's seq_id is taken, so the run's later requests go on; the requests now ready."""
        queue = self._queues.get(model_id)
        if queue is None or seq_id < queue.next_seq_id:
            return []
        queue.waiting[seq_id] = None
        queue.arrived_at[seq_id] = time.monotonic()
        return self._advance(model_id, queue)

    def retire(self, model_id: str) -> list[TrainingRequest]:
        """Stop accepting a run's requests; the ones still waiting for an earlier seq_id (to fail)."""
        queue = self._queues.pop(model_id, None)
        return [request for request in (queue.waiting.values() if queue else []) if request is not None]

    def drain(self) -> list[TrainingRequest]:
        """Stop accepting any request; every waiting one (to fail)."""
        return [request for model_id in list(self._queues)
                for request in self._queues.pop(model_id).waiting.values() if request is not None]

    def finished(self, model_id: str) -> None:
        """A run's dispatched request is over: the run is idle from now if nothing else runs."""
        queue = self._queues.get(model_id)
        if queue is not None:
            queue.in_flight -= 1
            queue.idle_since = time.monotonic()
            self.metrics.set_queue_depth(model_id, len(queue.waiting) + queue.in_flight)

    def stalled_gaps(self, now: float, timeout: float) -> list[GaveUp]:
        """Give up on each seq_id that has not arrived within `timeout`; the run goes on after it.

        The timeout counts from when the run went idle (its last dispatched request finished) or the
        first request queued behind the gap arrived, whichever is later, so a gap is never blamed for
        time the run spent computing.
        """
        given_up = []
        for model_id, queue in self._queues.items():
            if not queue.waiting or queue.in_flight:
                continue
            first_waiting = min(queue.arrived_at.values())
            if now - max(queue.idle_since, first_waiting) < timeout:
                continue
            missing = queue.next_seq_id
            error = InvalidRequest(f"seq_id {missing} of {model_id} never arrived within {timeout:g} s "
                                   f"(it was lost, or refused before its seq_id could be read); the requests "
                                   f"queued behind it are failed and the run goes on")
            failed = []
            for seq_id in sorted(queue.waiting):
                request = queue.waiting.pop(seq_id)
                if request is not None:
                    failed.append(request)
                queue.next_seq_id = seq_id + 1
            queue.arrived_at.clear()
            given_up.append(GaveUp(model_id, missing, failed, error))
            logger.warning("event=seq_gap_timeout model_id=%s missing_seq_id=%d", model_id, missing)
        return given_up

    def _advance(self, model_id: str, queue: RunQueue) -> list[TrainingRequest]:
        """Take the run's requests while the next seq_id is there."""
        ready = []
        while queue.next_seq_id in queue.waiting:
            request = queue.waiting.pop(queue.next_seq_id)
            del queue.arrived_at[queue.next_seq_id]
            queue.next_seq_id += 1
            if request is not None:
                queue.in_flight += 1
                request.sequenced = True
                ready.append(request)
        self.metrics.set_queue_depth(model_id, len(queue.waiting) + queue.in_flight)
        return ready
