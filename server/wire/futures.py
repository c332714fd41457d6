"""Wire types of futures: the immediate answer of every asynchronous endpoint, and what a poll of
retrieve_future gets back while it waits or when the request failed."""

from __future__ import annotations

from typing import Literal

from server.wire.base import Id, WireRequest, WireResponse


class FutureRetrieveRequest(WireRequest):
    request_id: Id
    allow_metadata_only: bool = False


class UntypedAPIFuture(WireResponse):
    """Immediate answer of every asynchronous endpoint."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None
    """asample only: one id per requested sample, in order."""


class TryAgainResponse(WireResponse):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    queue_state_reason: str | None = None


class RequestFailedResponse(WireResponse):
    error: str
    category: Literal["user", "server", "unknown"]
