"""Tinker wire types of the checkpoint lifecycle and of session search (SDK 0.38 names and fields).

External weights (save_weights_external, signed URLs), copy_weights, checkpoint TTLs, weights access
tokens, session projects and `sessions/search`. Shapes only, as in `base.py`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal, Union

from pydantic import AwareDatetime, Base64Bytes, Field, model_validator

from server.wire.base import (MAX_LIST_LENGTH, MAX_METADATA_KEYS, Id, Int32, Name, SeqId, TtlSeconds, WireRequest,
                              WireResponse)
from server.wire.weights import CheckpointName

# ---------------------------------------------------------------------------------------------
# External weights, copies, TTLs and access tokens.


class SaveWeightsExternalRequest(WireRequest):
    type: Literal["save_weights_external"] = "save_weights_external"
    model_id: Id
    path: CheckpointName
    """Checkpoint name."""
    seq_id: SeqId | None = None
    ttl_seconds: TtlSeconds | None = None
    age_encryption_recipients: list[str] | None = None
    """age recipients (age1... keys or SSH public keys) every file is encrypted to, stored as NAME.age."""


class SaveWeightsExternalResponse(WireResponse):
    type: Literal["save_weights_external"] = "save_weights_external"
    path: str
    size_bytes: int


class ExternalWeightsUrlsResponse(WireResponse):
    urls: dict[str, str]
    """A signed URL per file, keyed by its path relative to the checkpoint."""
    expires: datetime


class CheckpointTtlRequest(WireRequest):
    ttl_seconds: TtlSeconds | None = None
    """None removes the expiry."""


class CopyWeightsRequest(WireRequest):
    """Into a new run of a new session in `destination_project_id`, or into run `model_seq_id` of `session_id`."""

    source_path: Id
    destination_project_id: str | None = Field(default=None, min_length=1, max_length=200)
    session_id: Id | None = None
    model_seq_id: Int32 | None = None
    ttl_seconds: TtlSeconds | None = None
    weights_access_token: str | None = None

    @model_validator(mode="after")
    def _one_destination(self) -> CopyWeightsRequest:
        into_session = self.session_id is not None and self.model_seq_id is not None
        if into_session == (self.destination_project_id is not None) or \
                (self.session_id is None) != (self.model_seq_id is None):
            raise ValueError("copy_weights needs destination_project_id, or session_id and model_seq_id")
        return self


class CopyWeightsResponse(WireResponse):
    tinker_path: str


class WeightsAccessTokenResponse(WireResponse):
    weights_access_token: str
    """Lets its holder load, sample and copy this checkpoint (as `weights_access_token`) until it is saved again
    or deleted."""


class AssignSessionProjectRequest(WireRequest):
    project_id: str = Field(min_length=1, max_length=200)


# ---------------------------------------------------------------------------------------------
# sessions/search


class OwnSearchOwner(WireRequest):
    type: Literal["own"] = "own"


class AccessibleSearchOwner(WireRequest):
    type: Literal["accessible"] = "accessible"


class UserSearchOwner(WireRequest):
    type: Literal["user"] = "user"
    owner_urns: list[str] = Field(min_length=1, max_length=10)


SearchOwner = Annotated[Union[OwnSearchOwner, AccessibleSearchOwner, UserSearchOwner], Field(discriminator="type")]


class ActiveStatusQuery(WireRequest):
    type: Literal["active"] = "active"


class CancelledStatusQuery(WireRequest):
    type: Literal["cancelled"] = "cancelled"


class FailedStatusQuery(WireRequest):
    type: Literal["failed"] = "failed"


ClientFinishReason = Literal["success", "errored", "interrupted"]


class ClientFinishedStatusQuery(WireRequest):
    type: Literal["client_finished"] = "client_finished"
    reasons: list[ClientFinishReason] | None = Field(default=None, min_length=1)
    """None matches every reason."""


StatusQuery = Annotated[
    Union[ActiveStatusQuery, CancelledStatusQuery, FailedStatusQuery, ClientFinishedStatusQuery],
    Field(discriminator="type"),
]


class SessionSearchCursor(WireResponse):
    """Where the next page starts: the last session of this one."""

    last_created_at: AwareDatetime
    last_session_id: str


class SessionSearchRequest(WireRequest):
    session_id: Id | None = None
    project_ids: list[Name] | None = Field(default=None, max_length=MAX_LIST_LENGTH)
    user_metadata: dict[str, str] = Field(default_factory=dict, max_length=MAX_METADATA_KEYS)
    display_name: Name | None = Field(default=None, min_length=1)
    owner: SearchOwner = Field(default_factory=OwnSearchOwner)
    statuses: list[StatusQuery] | None = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SessionSearchCursor | None = None


class FinishReasonBody(WireResponse):
    type: ClientFinishReason


class SessionActive(WireResponse):
    type: Literal["active"] = "active"


class ClientSessionFinished(WireResponse):
    type: Literal["client_finished"] = "client_finished"
    reason: FinishReasonBody


class SessionSummary(WireResponse):
    session_id: str
    created_at: datetime
    owner: str
    project_id: str
    status: SessionActive | ClientSessionFinished | None = None
    """None when the session neither finished by its client's word nor is running (it timed out, say)."""
    checkpoints_count: int
    display_name: str | None = None
    user_metadata: dict[str, str] | None = None
    checkpoint_storage_bytes: int | None = None


class SessionSearchResponse(WireResponse):
    sessions: list[SessionSummary]
    next_cursor: SessionSearchCursor | None = None


# ---------------------------------------------------------------------------------------------
# This server's own: importing a PEFT LoRA adapter made elsewhere (POST /api/v1/adapters/import).


class ImportAdapterRequest(WireRequest):
    name: CheckpointName
    """The name of the two checkpoints the import makes (weights/NAME and sampler_weights/NAME)."""
    adapter_config: dict
    """adapter_config.json, as PEFT wrote it."""
    adapter_model: Base64Bytes
    """adapter_model.safetensors, base64-encoded."""


class ImportAdapterResponse(WireResponse):
    training_run_id: str
    tinker_path: str
    """weights/NAME: for create_training_client_from_state."""
    sampler_path: str
    """sampler_weights/NAME: for create_sampling_client."""
