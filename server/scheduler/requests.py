"""A training request as the scheduler holds it, from its journaling to its outcome.

Shared by the rooms of the scheduler: ordering (ordering.py) makes it ready, planning (passes.py)
picks it for a cycle, the loop (loop.py) runs it and hands its outcome to the journal (outcomes.py).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.training.operations import Operation

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
