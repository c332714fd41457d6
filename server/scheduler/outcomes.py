"""What a finished request answers: `Outcome`, and how an error a request's work raised becomes one.

Both kinds of futures end in an Outcome: training ones are journaled (scheduler.py), sampling ones
live in memory (sampling.py). `retrieve_future` turns an Outcome into the response. Knows nothing
about where outcomes are kept or how requests run.
"""

import logging
from dataclasses import dataclass

from server.errors import InsufficientStorage, TinkerServerError, without_server_paths
from server.store.db import storage_failure

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
