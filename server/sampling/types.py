"""The sampling engine's interface (`SamplingEngine`): one `SamplingRequest` in, one `SampleOutput` out.

A request carries everything that decides its result (prompt, options, adapter, how many samples,
which logprobs), so engines keep no per-request state anywhere else and a new per-request option is
one new field here. Shared by the embedded engine (embedded.py) and vLLM (vllm.py), neither of which
imports the other, so callers do not care which engine served them. Completions are the wire's own
`SampledSequence`. Knows nothing about HTTP or the store.
"""

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from server.errors import InvalidRequest
from server.lora.layers import LoraAdapter
from server.rendering.chunks import RenderedInput
from server.wire.proto import SampledSequence, TopkRows


@dataclass(frozen=True)
class SamplingOptions:
    """How to sample one request: Tinker's SamplingParams after the caller resolved stops."""

    max_tokens: int
    """Hard cap on the number of generated tokens."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 (or 0, as vLLM allows) means no limit."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    seed: int | None = None
    """Seed of the request's generator; None draws a fresh one."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop when one is sampled; it stays as the last output token. EOS ids come from the caller."""
    stop_strings: tuple[str, ...] = ()
    """Stop right after the token that makes the decoded completion contain one."""

    def __post_init__(self):
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (no limit) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class PromptTargets:
    """Token ids whose logprobs to report at chosen prompt positions (Tinker's target_prompt_logprobs), as
    parallel arrays: cell i asks for log p(token_ids[i]) at prompt position positions[i] (1 or later)."""

    positions: np.ndarray
    """int64 [N]: the scored position of each cell, given the tokens before it."""
    token_ids: np.ndarray
    """int64 [N], each below the vocabulary size."""


@dataclass(frozen=True)
class LogprobOptions:
    """Which logprobs a request wants besides each sampled token's (always returned).

    Every logprob is of the model's distribution before temperature, top-k and top-p, with the media
    placeholders at zero probability (server/models/logprobs.py).
    """

    prompt_logprobs: bool = False
    """Each prompt token's logprob given the tokens before it."""
    topk_prompt_logprobs: int = 0
    """The k best (token, logprob) at each prompt position; 0: none."""
    topk_sample_logprobs: int = 0
    """The k best (token, logprob) at each sampled position; 0: none."""
    target_prompt_logprobs: PromptTargets | None = None
    """Logprobs of chosen ids at chosen prompt positions."""
    prompt_alt_tokens_k: int = 0
    """k draws, with replacement and at the request's temperature (no top-k or top-p), from the
    distribution at every prompt position after the first, with their logprobs; 0: none."""

    @property
    def scores_prompt(self) -> bool:
        """Whether the request needs the model's distribution at prompt positions (not only the last)."""
        return (self.prompt_logprobs or self.topk_prompt_logprobs > 0 or self.target_prompt_logprobs is not None
                or self.prompt_alt_tokens_k > 0)


@dataclass(frozen=True)
class AdapterRef:
    """The adapter of one sampling request, fixed when the request was accepted."""

    name: str
    """Unique per version of the weights (a new name after an overwrite): the key of vLLM's caches."""
    directory: Path | None
    """Its PEFT files (saved checkpoints, and snapshots where they are written); None: in memory only."""
    weights: LoraAdapter | None = None
    """In memory already (snapshots of the embedded engine); else loaded from `directory` by an engine that
    needs the tensors."""
    checked_finite: bool = False
    """Its weights were checked finite when it was made (every snapshot); else a saved checkpoint's files are
    checked before vLLM first loads them."""


TokenHook = Callable[[int, int, float, list[tuple[int, float]] | None], None]
"""Called with (sample index, token id, its logprob, its top-k alternatives or None) for each token as it is
sampled, on an engine thread: it must return at once (hand the token to an event loop, say)."""


@dataclass(frozen=True)
class SamplingRequest:
    """One prompt to sample: everything that decides the result travels in here."""

    prompt: RenderedInput
    """The sampling renderer's collapsed prompt: one image pad per image, plus the images."""
    options: SamplingOptions
    adapter: AdapterRef | None = None
    """None samples the base model."""
    num_samples: int = 1
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    on_token: TokenHook | None = field(default=None, compare=False)
    """Streams each token as it is sampled, before the future completes. An engine that gets whole results only
    (vLLM) calls it for none: the tokens it did not stream are in the result. None: nothing is streamed."""

    def __post_init__(self):
        if self.num_samples < 1:
            raise InvalidRequest(f"num_samples must be at least 1, got {self.num_samples}")


@dataclass(frozen=True)
class PromptAltTokens:
    """prompt_alt_tokens_k's draws: row i holds the k draws at prompt position i + 1."""

    tokens: np.ndarray
    """int64 [P - 1, k]."""
    logprobs: np.ndarray
    """float32 [P - 1, k]: each draw's logprob."""


@dataclass
class SampleOutput:
    """The completions of one prompt, and its logprobs when they were asked for."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    """Per position of the expanded prompt; None at position 0, 0 where the token is an image's."""
    topk_prompt_logprobs: TopkRows | None = None
    """Per prompt position, the k best (token, logprob), best first; None at position 0."""
    target_prompt_logprobs: np.ndarray | None = None
    """float32 [N]: the logprob of each cell of the request's PromptTargets, in order (0 where the id
    is a media placeholder, which is given, never predicted)."""
    prompt_alt_tokens: PromptAltTokens | None = None
    prompt_cache_hit_tokens: int = 0
    """Prompt positions the engine took from its prefix cache instead of running them."""


class SamplingEngine(Protocol):
    def submit(self, request: SamplingRequest) -> Future[SampleOutput]:
        """Start sampling one request; its future completes (from the engine's own thread) when it is done."""

    def sample(self, request: SamplingRequest) -> SampleOutput:
        """Sample one request; blocks the calling thread until it is done (`submit(request).result()`)."""

    def forget(self, adapter_name: str) -> None:
        """Release an adapter whose weights are gone (deleted or overwritten checkpoint, dropped snapshot)."""

    def close(self) -> None:
        """Stop serving: requests still waiting fail, and the engine's processes and threads end."""
