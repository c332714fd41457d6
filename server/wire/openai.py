"""The OpenAI-compatible inference API's bodies: chat completions, text completions and the model list.

Requests accept the fields this server honours and refuse the rest by name (tools, penalties, logit
bias, echo): a field that would silently change nothing is a 400, not a surprise. Responses carry the
fields the official `openai` client reads. Knows nothing about rendering, engines or HTTP.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.wire.base import MAX_INT32, Seed

MAX_TOP_LOGPROBS = 20
"""OpenAI's own limit on top_logprobs (chat) and logprobs (completions)."""


class OpenAIRequest(BaseModel):
    """Base of request bodies: an unknown field is refused by name, and floats are finite."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class StreamOptions(OpenAIRequest):
    include_usage: bool = False
    """Send one more chunk before [DONE] with the request's token counts."""


class SamplingFields(OpenAIRequest):
    """What chat and text completions share."""

    model: str = Field(min_length=1, max_length=4096)
    """A base model id, a tinker:// sampler weights path, or `<base model id>;<tinker:// path>`."""
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1, le=MAX_INT32)
    """Not OpenAI's (vLLM's extension); -1 means no limit."""
    n: int = Field(default=1, ge=1, le=MAX_INT32)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted and not used."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if any(not s for s in ([stop] if isinstance(stop, str) else stop or [])):
            raise ValueError("stop strings must be non-empty")
        return stop

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise ValueError(f"{name} is not supported by this server (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ImageURL(OpenAIRequest):
    url: str
    """A data: URL (data:image/png;base64,...); this server fetches nothing from the network."""
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted and not used: images are sized by the model's own processor."""


class TextPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ImagePart(OpenAIRequest):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant"]
    """developer is OpenAI's newer name for system, and is rendered as system."""
    content: str | list[ContentPart]
    name: str | None = None
    """Accepted and not used (chat templates do not render it)."""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    """None lets the server pick (its --max-new-tokens-default)."""
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    """OpenAI's newer name for max_tokens."""
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    """Text, token ids, or a list of either (one completion group per prompt)."""
    max_tokens: int = Field(default=16, ge=1, le=MAX_INT32)
    """OpenAI's default for completions."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Each sampled token's logprob, and this many most likely alternatives."""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _refuse_unsupported_completion(self):
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported by this server (only best_of = n)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is empty")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


# ---------------------------------------------------------------------------------------------
# Responses.


class Usage(BaseModel):
    prompt_tokens: int
    """The prompt's positions, image tokens included."""
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChatLogprobs | None = None


class Envelope(BaseModel):
    """What every response and stream chunk starts with."""

    id: str
    created: int
    model: str


class ChatCompletion(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class Completion(Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
