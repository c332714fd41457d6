"""Wire types of a run's weights: save_weights, save_weights_for_sampler, load_weights, and the
weights info of a tinker path. Checkpoint listings are in `rest.py`, the rest of the lifecycle in
`lifecycle.py`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, model_validator

from server.wire.base import (MAX_CHECKPOINT_NAME_LENGTH, Id, Int32, SampleSeqId, SeqId, StringMetadata,
                              TtlSeconds, UserMetadata, WireRequest, WireResponse)
from server.wire.models import OptimizerConfig


def _check_checkpoint_name(name: str) -> str:
    # A tinker path is tinker://{run}/{segment}/{name}; the SDK parser needs exactly three parts.
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"checkpoint name {name!r} must be non-empty and contain no '/'")
    if len(name.encode()) > MAX_CHECKPOINT_NAME_LENGTH:
        raise ValueError(f"checkpoint name of {len(name.encode())} bytes is over the limit of "
                         f"{MAX_CHECKPOINT_NAME_LENGTH}")
    return name


CheckpointName = Annotated[str, AfterValidator(_check_checkpoint_name)]


class SaveWeightsRequest(WireRequest):
    type: Literal["save_weights"] = "save_weights"
    model_id: Id
    path: CheckpointName | None = None
    """Checkpoint name (not a path, despite the field name)."""
    seq_id: SeqId | None = None
    ttl_seconds: TtlSeconds | None = None
    overwrite: bool = False
    user_metadata: StringMetadata = None


class SaveWeightsForSamplerRequest(WireRequest):
    """Named form: `path`. Ephemeral form: `sampling_session_seq_id` and no `path`."""

    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"
    model_id: Id
    path: CheckpointName | None = None
    sampling_session_seq_id: SampleSeqId | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: SeqId | None = None
    ttl_seconds: TtlSeconds | None = None
    user_metadata: StringMetadata = None

    @model_validator(mode="after")
    def _named_or_ephemeral(self) -> SaveWeightsForSamplerRequest:
        if self.path is None and self.sampling_session_seq_id is None:
            raise ValueError("save_weights_for_sampler needs a path or a sampling_session_seq_id")
        if self.path is not None and self.kind == "inflight":
            raise ValueError("kind='inflight' is for the ephemeral form (save_weights_and_get_sampling_client); "
                             "a named save is a snapshot")
        return self


class LoadWeightsRequest(WireRequest):
    """Either into an existing model (`model_id`) or create-via-load (`session_id` + `model_seq_id`)."""

    type: Literal["load_weights"] = "load_weights"
    model_id: Id | None = None
    seq_id: SeqId | None = None
    session_id: Id | None = None
    model_seq_id: Int32 | None = None
    path: Id
    optimizer: bool = False
    base_model: str | None = None
    user_metadata: UserMetadata = None
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None

    @model_validator(mode="after")
    def _one_addressing_mode(self) -> LoadWeightsRequest:
        into_existing = self.model_id is not None
        create_via_load = self.session_id is not None or self.model_seq_id is not None
        if into_existing == create_via_load:
            raise ValueError(
                "load_weights needs either model_id (load into an existing model) or "
                "session_id + model_seq_id (create a model from the checkpoint), not both"
            )
        if create_via_load and (self.session_id is None or self.model_seq_id is None):
            raise ValueError("create-via-load needs both session_id and model_seq_id")
        return self


class WeightsInfoRequest(WireRequest):
    tinker_path: Id


class SaveWeightsResponse(WireResponse):
    type: Literal["save_weights"] = "save_weights"
    path: str


class SaveWeightsForSamplerResponse(WireResponse):
    """Named saves return `path`, ephemeral ones `sampling_session_id`."""

    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"
    path: str | None = None
    sampling_session_id: str | None = None


class LoadWeightsResponse(WireResponse):
    type: Literal["load_weights"] = "load_weights"
    path: str | None = None
    model_id: str | None = None


class WeightsInfoResponse(WireResponse):
    base_model: str
    is_lora: bool
    optimizer_config: OptimizerConfig | None = None
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None
