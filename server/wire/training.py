"""Wire types of training: forward_backward (decoded from protobuf by proto.py) and optim_step with
its optimizer params."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import torch
from pydantic import AliasChoices, BaseModel, ConfigDict, Discriminator, Field, Tag

from server.wire.base import Id, Name, SeqId, WireRequest, WireResponse
from server.wire.model_input import ModelInput


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


class OptimStepRequest(WireRequest):
    type: Literal["optim_step"] = "optim_step"
    model_id: Id
    seq_id: SeqId | None = None
    adam_params: OptimParams = Field(
        validation_alias=AliasChoices("adam_params", "optimizer_params", "optim_params")
    )
    """AdamParams, or DimuonParams when the body names `"type": "dimuon"`."""


class OptimStepResponse(WireResponse):
    metrics: dict[str, float] | None = None
