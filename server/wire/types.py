"""Tinker wire types: pydantic models for every JSON body the server reads or writes.

Names and fields follow the `tinker` SDK 0.38 so that the same words run from route to trainer.
Requests ignore unknown fields; responses leave out fields that are None, because the SDK
validates responses strictly and expects omission. This module knows the shapes only, not what
any route, scheduler or engine does with them; the protobuf codec lives in `proto.py`.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal, Union

import numpy as np
import torch
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)

# A CSR tensor is tiny on the wire but can name a huge dense shape; refuse to densify past this.
MAX_DENSE_ELEMENTS = 1 << 28

# Bounds on the numbers a client sends: past them a value is a mistake (or an attack), and refusing
# it here gives a 400 that names the field instead of an overflow deep in the database or engine.
MAX_INT32 = 2**31 - 1
MAX_SEQ_ID = 2**63 - 1
"""Sampling clones number requests clone_id * 1e9 + k (clone_id up to 1e9), past 32 bits."""
MAX_ID_LENGTH = 512
MAX_LOGPROB_WIDTH = 1024
"""Most (token, logprob) pairs a sampling request may ask for per position: top-k widths,
prompt_alt_tokens_k, and target_prompt_logprobs' ids per position."""
MIN_TTL_SECONDS, MAX_TTL_SECONDS = 3600, 10 * 366 * 24 * 3600

SeqId = Annotated[int, Field(ge=1, le=MAX_SEQ_ID)]
"""A training request's place in its model's order (the SDK counts from 1; 0 is the model's creation)."""
SampleSeqId = Annotated[int, Field(ge=0, le=MAX_SEQ_ID)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
Int32 = Annotated[int, Field(ge=0, le=MAX_INT32)]
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]
TtlSeconds = Annotated[int, Field(ge=MIN_TTL_SECONDS, le=MAX_TTL_SECONDS)]
"""A checkpoint's time to live: 1 hour to 10 years, as the SDK documents (None: it never expires)."""

# Free-form text the journal keeps (names, tags, metadata), bounded so that no key holder can fill the
# disk or the answers of sessions/search through it; each refusal is a 400 that names the field.
MAX_NAME_LENGTH = 4096
"""Display names, project ids, tags, loss names, SDK versions (the cookbook names a session by its log path)."""
MAX_CHECKPOINT_NAME_LENGTH = 255
"""A checkpoint's name is a directory's name."""
MAX_LIST_LENGTH = 64
"""Tags of a session, project ids of a search, age recipients."""
MAX_METADATA_KEYS = 64
MAX_METADATA_BYTES = 16 * 1024
"""user_metadata as JSON (sessions, runs, checkpoints)."""
Name = Annotated[str, Field(max_length=MAX_NAME_LENGTH)]


def _bounded_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if len(value) > MAX_METADATA_KEYS:
        raise ValueError(f"user_metadata has {len(value)} keys, over the limit of {MAX_METADATA_KEYS}")
    size = len(json.dumps(value, default=str))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"user_metadata is {size} bytes as JSON, over the limit of {MAX_METADATA_BYTES}")
    return value


UserMetadata = Annotated[dict[str, Any] | None, AfterValidator(_bounded_metadata)]
StringMetadata = Annotated[dict[str, str] | None, AfterValidator(_bounded_metadata)]


def _reject_nul(value: Any) -> Any:
    # PostgreSQL cannot store NUL in text, and no name, id or path needs one.
    if isinstance(value, str):
        strings: Any = (value,)
    elif isinstance(value, dict):
        strings = [s for pair in value.items() for s in pair if isinstance(s, str)]
    elif isinstance(value, list) and value and isinstance(value[0], str):
        strings = value
    else:
        return value
    if any("\x00" in s for s in strings if isinstance(s, str)):
        raise ValueError("text fields may not contain NUL characters")
    return value


class WireRequest(BaseModel):
    """Base of request bodies: unknown fields are ignored, so newer SDKs keep working. Floats must
    be finite, and no text field may hold a NUL character."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul_in_text(cls, value: Any) -> Any:
        return _reject_nul(value)


class WireResponse(BaseModel):
    """Base of response bodies: None fields are omitted, which every SDK response model accepts."""

    model_config = ConfigDict(protected_namespaces=())

    # Unannotated on purpose: pydantic then keeps each model's own schema for OpenAPI.
    @model_serializer(mode="wrap")
    def _omit_none(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


# ---------------------------------------------------------------------------------------------
# Model input: the chunk list shared by sampling (JSON) and training (protobuf).


class EncodedTextChunk(WireRequest):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[Int32]


class ImageChunk(WireRequest):
    """An image file (png or jpeg). JSON carries it as standard base64, protobuf as raw bytes."""

    type: Literal["image"] = "image"
    data: bytes
    format: Literal["png", "jpeg"]
    expected_tokens: Int32 | None = None
    """Advisory token count from the client; the server computes the true one."""

    @field_validator("data", mode="before")
    @classmethod
    def _decode_base64(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as error:
            raise ValueError(f"image data is not valid standard base64 ({error})") from None

    @field_serializer("data", when_used="json")
    def _encode_base64(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")


class ImageAssetPointerChunk(WireRequest):
    """An image named by path or URL instead of inlined (sampling requests only)."""

    type: Literal["image_asset_pointer"] = "image_asset_pointer"
    format: Literal["png", "jpeg"]
    location: Annotated[str, Field(min_length=1, max_length=4096)]
    expected_tokens: Int32 | None = None


Chunk = Annotated[
    Union[EncodedTextChunk, ImageChunk, ImageAssetPointerChunk], Field(discriminator="type")
]

DMEL_NOT_SUPPORTED = "audio (dmel) chunks are not supported"


class ModelInput(WireRequest):
    chunks: list[Chunk]

    @field_validator("chunks", mode="before")
    @classmethod
    def _reject_dmel(cls, chunks: Any) -> Any:
        # Checked before the union so the user gets a sentence, not "tag 'dmel' does not match".
        if isinstance(chunks, list):
            for chunk in chunks:
                if isinstance(chunk, dict) and chunk.get("type") == "dmel":
                    raise ValueError(DMEL_NOT_SUPPORTED)
        return chunks


# ---------------------------------------------------------------------------------------------
# Tensors in JSON (SampleRequest.target_prompt_logprobs).


def densify_csr(
    values: np.ndarray,
    crow_indices: np.ndarray,
    col_indices: np.ndarray,
    shape: list[int],
    pad_value: float = 0,
) -> np.ndarray:
    """Expand a 2-D CSR tensor to dense, with `pad_value` in every unlisted cell."""
    check_csr(len(values), crow_indices, col_indices, shape)
    num_rows, num_cols = shape
    if num_rows * num_cols > MAX_DENSE_ELEMENTS:
        raise ValueError(f"sparse tensor of shape {shape} is too large to densify")
    dense = np.full((num_rows, num_cols), pad_value, dtype=values.dtype)
    dense[np.repeat(np.arange(num_rows), np.diff(crow_indices)), col_indices] = values
    return dense


def check_csr(num_values: int, crow_indices: np.ndarray, col_indices: np.ndarray, shape: list[int]) -> None:
    """Raise ValueError unless the arrays are a valid 2-D CSR layout of `shape` (nothing is allocated)."""
    if len(shape) != 2:
        raise ValueError(f"a sparse CSR tensor needs a 2-D shape, got {shape}")
    num_rows, num_cols = shape
    if num_rows < 0 or num_cols < 0:
        raise ValueError(f"shape {shape} has a negative dimension")
    if len(crow_indices) != num_rows + 1:
        raise ValueError(
            f"sparse CSR crow_indices has {len(crow_indices)} entries, expected rows+1 = {num_rows + 1}"
        )
    if len(col_indices) != num_values:
        raise ValueError(
            f"sparse CSR has {num_values} values but {len(col_indices)} col_indices"
        )
    row_counts = np.diff(crow_indices)
    if crow_indices[0] != 0 or crow_indices[-1] != num_values or np.any(row_counts < 0):
        raise ValueError(
            "sparse CSR crow_indices must start at 0, never decrease, and end at the number of values"
        )
    if len(col_indices) and (col_indices.min() < 0 or col_indices.max() >= num_cols):
        raise ValueError(f"sparse CSR col_indices must lie in [0, {num_cols})")


class TensorData(WireRequest):
    """A tensor as JSON: flat `data`, dense or 2-D sparse CSR."""

    data: list[int] | list[float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    @model_validator(mode="after")
    def _check_layout(self) -> TensorData:
        if (self.sparse_crow_indices is None) != (self.sparse_col_indices is None):
            raise ValueError("sparse_crow_indices and sparse_col_indices come together")
        if self.sparse_crow_indices is None and self.shape is not None:
            if min(self.shape, default=0) < 0 or math.prod(self.shape) != len(self.data):
                raise ValueError(f"shape {self.shape} does not hold {len(self.data)} values")
        if self.sparse_crow_indices is not None:
            if self.shape is None:
                raise ValueError("a sparse CSR tensor needs its dense shape")
            check_csr(len(self.data), np.asarray(self.sparse_crow_indices, dtype=np.int64),
                      np.asarray(self.sparse_col_indices, dtype=np.int64), self.shape)
        return self

    def cells(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, value) of each cell the tensor lists, in the order of `data`: every cell of a dense
        2-D tensor, only the listed ones of a CSR tensor (which never densifies)."""
        values = np.asarray(self.data, dtype=np.int64 if self.dtype == "int64" else np.float32)
        if self.sparse_crow_indices is None:
            num_rows, num_cols = self.shape
            return np.repeat(np.arange(num_rows), num_cols), values
        return np.repeat(np.arange(self.shape[0]), np.diff(self.sparse_crow_indices)), values



# ---------------------------------------------------------------------------------------------
# Training: forward_backward (decoded from protobuf by proto.py), optimizer, LoRA.


class ProvenanceSpan(BaseModel):
    """A run of a datum field's positions and where its tokens came from (Datum.with_provenance).

    `prompt`: positions [offset, offset + length) of the prompt of the request that sampled
    `sequence_id`; `sampled`: positions [offset, offset + length) of that sequence's sampled tokens.
    """

    model_config = ConfigDict(frozen=True)

    source: Literal["prompt", "sampled"]
    sequence_id: str = Field(min_length=1)
    offset: int = Field(ge=0)
    length: int = Field(ge=0)


class Datum(BaseModel):
    """One training example as decoded from protobuf; tensors are dense torch tensors."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=())

    model_input: ModelInput
    loss_fn_inputs: dict[str, torch.Tensor]
    """float32 or int64 tensors, shaped as the client declared them (e.g. [N] or [N, K])."""
    model_input_spans: list[ProvenanceSpan] | None = None
    """Runs tiling the model input's positions; set together with loss_fn_input_spans or not at all."""
    loss_fn_input_spans: list[ProvenanceSpan] | None = None
    """Runs tiling the rows of target_tokens."""


class ForwardBackwardRequest(BaseModel):
    """A `forward_backward` call (also `forward`, with `forward_only`)."""

    model_config = ConfigDict(protected_namespaces=())

    model_id: Id
    seq_id: SeqId
    loss_fn: Name
    loss_fn_config: dict[str, float | str] = Field(default_factory=dict)
    forward_only: bool = False
    data: list[Datum]


class LoraConfig(WireRequest):
    rank: int = Field(default=32, gt=0, le=1 << 16)
    """The server's --max-lora-rank applies on top."""
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True

    @model_validator(mode="after")
    def _train_something(self) -> LoraConfig:
        if not (self.train_unembed or self.train_mlp or self.train_attn):
            raise ValueError("at least one of train_unembed, train_mlp, train_attn must be true")
        return self


class OptimizerConfig(BaseModel):
    """Optimizer family, fixed at model creation; family fields (e.g. dimuon `version`) kept."""

    model_config = ConfigDict(extra="allow")

    type: Literal["adamw", "dimuon"] = "adamw"


MAX_LEARNING_RATE = 10.0


class AdamParams(WireRequest):
    learning_rate: float = Field(default=1e-4, ge=0, le=MAX_LEARNING_RATE)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0, le=1)
    """Above 0: AdamW divides by sqrt(v) + eps, and v is 0 wherever a gradient was."""
    weight_decay: float = Field(default=0.0, ge=0, le=10)
    """Decoupled (AdamW) weight decay."""
    grad_clip_norm: float = Field(default=0.0, ge=0, le=1e12)
    """Clip the global gradient norm to this; 0 means no clipping."""


class DimuonParams(WireRequest):
    type: Literal["dimuon"] = "dimuon"
    learning_rate: float = Field(ge=0, le=MAX_LEARNING_RATE)
    grad_clip_norm: float = Field(default=0.0, ge=0, le=1e12)
    beta1: float = Field(default=0.9, ge=0, lt=1)


def _optimizer_family(value: Any) -> str:
    # AdamParams travels without a `type`; other families name themselves.
    if isinstance(value, dict):
        return value.get("type", "adamw")
    return getattr(value, "type", "adamw")


OptimParams = Annotated[
    Union[Annotated[AdamParams, Tag("adamw")], Annotated[DimuonParams, Tag("dimuon")]],
    Discriminator(_optimizer_family),
]


# ---------------------------------------------------------------------------------------------
# Sampling parameters.


@dataclass(frozen=True)
class StopConditions:
    stop_strings: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    """True only for `stop=[]`, which the SDK defines as "disable every stop, EOS included"."""


class SamplingParams(WireRequest):
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    """None lets the server pick."""
    seed: Seed | None = None
    stop: str | list[str] | list[Int32] | None = None
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_k: int = Field(default=-1, ge=-1, le=MAX_INT32)
    """-1 (or 0) means no limit; normalized to -1."""
    top_p: float = Field(default=1.0, gt=0, le=1)

    @field_validator("top_k")
    @classmethod
    def _zero_means_no_limit(cls, top_k: int) -> int:
        return -1 if top_k == 0 else top_k

    @field_validator("stop")
    @classmethod
    def _no_empty_stop_string(cls, stop: Any) -> Any:
        strings = [stop] if isinstance(stop, str) else stop or []
        if any(isinstance(s, str) and not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        return stop

    def stop_conditions(self) -> StopConditions:
        """The `stop` field split into strings and token ids."""
        if self.stop is None:
            return StopConditions(stop_strings=[], stop_token_ids=[], ignore_eos=False)
        if isinstance(self.stop, str):
            return StopConditions(stop_strings=[self.stop], stop_token_ids=[], ignore_eos=False)
        return StopConditions(
            stop_strings=[s for s in self.stop if isinstance(s, str)],
            stop_token_ids=[t for t in self.stop if isinstance(t, int)],
            ignore_eos=len(self.stop) == 0,
        )


# ---------------------------------------------------------------------------------------------
# Requests.


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


class CreateModelRequest(WireRequest):
    type: Literal["create_model"] = "create_model"
    session_id: Id
    model_seq_id: Int32
    base_model: Id
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    user_metadata: UserMetadata = None

    @field_validator("lora_config", "optimizer_config", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any) -> Any:
        return {} if value is None else value


class GetInfoRequest(WireRequest):
    type: Literal["get_info"] = "get_info"
    model_id: Id


class OptimStepRequest(WireRequest):
    type: Literal["optim_step"] = "optim_step"
    model_id: Id
    seq_id: SeqId | None = None
    adam_params: OptimParams = Field(
        validation_alias=AliasChoices("adam_params", "optimizer_params", "optim_params")
    )
    """AdamParams, or DimuonParams when the body names `"type": "dimuon"`."""


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


class CreateSamplingSessionRequest(WireRequest):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    session_id: Id
    sampling_session_seq_id: SampleSeqId
    base_model: Id | None = None
    model_path: Id | None = None

    @model_validator(mode="after")
    def _has_model(self) -> CreateSamplingSessionRequest:
        if self.base_model is None and self.model_path is None:
            raise ValueError("create_sampling_session needs a model_path or a base_model")
        return self


class SampleRequest(WireRequest):
    type: Literal["sample"] = "sample"
    sampling_session_id: Id | None = None
    seq_id: SampleSeqId | None = None
    base_model: Id | None = None
    model_path: Id | None = None
    num_samples: int = Field(default=1, ge=1, le=MAX_INT32)
    prompt: ModelInput
    sampling_params: SamplingParams
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=MAX_LOGPROB_WIDTH)
    topk_sample_logprobs: int = Field(default=0, ge=0, le=MAX_LOGPROB_WIDTH)
    prompt_logprobs_last_n: int | None = Field(default=None, ge=1, le=MAX_INT32)
    prompt_alt_tokens_k: int = Field(default=0, ge=0, le=MAX_LOGPROB_WIDTH)
    target_prompt_logprobs: TensorData | None = None
    """int64 token ids, [len(prompt) - 1, K]: cell [i, j] is scored at prompt position i + 1; -1 (or an
    unlisted CSR cell) asks for nothing."""
    record_stability_info: bool = False
    """Keep what was sampled, per returned sequence, for stable_reinforce to check and use."""

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _null_is_false(cls, value: Any) -> Any:
        return False if value is None else value

    @model_validator(mode="after")
    def _check_options(self) -> SampleRequest:
        if self.sampling_session_id is None and self.base_model is None and self.model_path is None:
            raise ValueError("sample needs a sampling_session_id, a model_path or a base_model")
        if self.prompt_logprobs_last_n is not None and not self.prompt_logprobs:
            raise ValueError("prompt_logprobs_last_n requires prompt_logprobs")
        targets = self.target_prompt_logprobs
        if targets is not None and (
            targets.dtype != "int64" or targets.shape is None or len(targets.shape) != 2
        ):
            raise ValueError("target_prompt_logprobs must be an int64 tensor of shape [len(prompt) - 1, K]")
        if targets is not None and targets.shape[1] > MAX_LOGPROB_WIDTH:
            raise ValueError(f"target_prompt_logprobs asks for {targets.shape[1]} ids per position; at most "
                             f"{MAX_LOGPROB_WIDTH} are accepted")
        return self


class FutureRetrieveRequest(WireRequest):
    request_id: Id
    allow_metadata_only: bool = False


class WeightsInfoRequest(WireRequest):
    tinker_path: Id


# ---------------------------------------------------------------------------------------------
# Responses.


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


class CreateModelResponse(WireResponse):
    type: Literal["create_model"] = "create_model"
    model_id: str


class ModelData(WireResponse):
    arch: str | None = None
    model_name: str | None = None
    """Must be set: the SDK's get_tokenizer() asserts on it."""
    tokenizer_id: str | None = None


class GetInfoResponse(WireResponse):
    type: Literal["get_info"] = "get_info"
    model_id: str
    model_data: ModelData
    optimizer_config: OptimizerConfig | None = None
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None


class OptimStepResponse(WireResponse):
    metrics: dict[str, float] | None = None


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


class CreateSamplingSessionResponse(WireResponse):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class GetSamplerResponse(WireResponse):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class SupportedModel(WireResponse):
    model_name: str
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


class ServerLimits(WireResponse):
    """What one request may ask for (the server's flags of the same names); the SDK ignores it, other
    clients read it to stay within."""

    max_sequence_length: int
    max_sample_tokens: int
    max_num_samples: int
    max_sampled_tokens_per_request: int
    max_images_per_prompt: int
    max_lora_rank: int
    max_request_bytes: int
    max_datums_per_request: int


class GetServerCapabilitiesResponse(WireResponse):
    supported_models: list[SupportedModel]
    limits: ServerLimits | None = None


class Checkpoint(WireResponse):
    checkpoint_id: str
    """Segment and name, e.g. "weights/step-100"."""
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


class Cursor(WireResponse):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(WireResponse):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(WireResponse):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(WireResponse):
    training_runs: list[TrainingRun]
    cursor: Cursor


class WeightsInfoResponse(WireResponse):
    base_model: str
    is_lora: bool
    optimizer_config: OptimizerConfig | None = None
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


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
