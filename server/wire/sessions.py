"""Wire types of a client's session: client config, create, heartbeat, finish, telemetry, the session
listings, and the server's health."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.wire.base import MAX_LIST_LENGTH, Id, Name, UserMetadata, WireRequest, WireResponse


class ClientConfigRequest(WireRequest):
    sdk_version: str | None = None


class CreateSessionRequest(WireRequest):
    type: Literal["create_session"] = "create_session"
    tags: list[Name] = Field(default_factory=list, max_length=MAX_LIST_LENGTH)
    user_metadata: UserMetadata = None
    sdk_version: Name | None = None
    project_id: Name | None = None
    display_name: Name | None = None


class SessionHeartbeatRequest(WireRequest):
    type: Literal["session_heartbeat"] = "session_heartbeat"
    session_id: Id


class FinishReason(WireRequest):
    type: Literal["success", "errored", "interrupted"]


class FinishSessionRequest(WireRequest):
    reason: FinishReason
    detail: str | None = None


class TelemetryBatch(BaseModel):
    """Client telemetry; accepted and not interpreted."""

    model_config = ConfigDict(extra="allow")

    events: list[Any] = Field(default_factory=list)
    session_id: str | None = None


class ClientConfigResponse(WireResponse):
    """Feature flags for the SDK; every omitted flag keeps the SDK's default."""

    proto_compress_fwdbwd: bool | None = None
    parallel_fwdbwd_chunks: bool | None = None
    fwdbwd_max_chunk_len: int | None = None
    fwdbwd_max_chunk_bytes_count: int | None = None
    sample_max_concurrent_requests: int | None = None


class CreateSessionResponse(WireResponse):
    type: Literal["create_session"] = "create_session"
    session_id: str
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatResponse(WireResponse):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class TelemetryResponse(WireResponse):
    status: Literal["accepted"] = "accepted"


class ListSessionsResponse(WireResponse):
    sessions: list[str]


class GetSessionResponse(WireResponse):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


class HealthResponse(WireResponse):
    status: Literal["ok", "degraded"] = "ok"
    detail: str | None = None
    """What is degraded (a full disk: requests that need it fail with 507 until space is freed)."""
