"""Wire types of training runs' creation and description: create_model with its LoRA and optimizer
configs, get_info, and the server's capabilities and limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.wire.base import Id, Int32, Seed, UserMetadata, WireRequest, WireResponse


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
