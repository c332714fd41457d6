"""Wire types of sampling: sampling params and their stop conditions, sampling sessions, and sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from server.wire.base import (MAX_INT32, MAX_LOGPROB_WIDTH, Id, Int32, SampleSeqId, Seed, WireRequest,
                              WireResponse)
from server.wire.model_input import ModelInput, TensorData


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


class CreateSamplingSessionResponse(WireResponse):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class GetSamplerResponse(WireResponse):
    sampler_id: str
    base_model: str
    model_path: str | None = None
