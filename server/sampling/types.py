"""What every sampling engine takes and returns: the options of one request and its completions.

Shared by the embedded engine (embedded.py) and the vLLM client (vllm.py) so that callers do not
care which engine served them. Knows nothing about prompts, images or adapters.
"""

from dataclasses import dataclass

from server.errors import InvalidRequest


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


@dataclass
class SampledSequence:
    """One completion."""

    tokens: list[int]
    logprobs: list[float]
    """Logprob of each token under the raw model distribution (no temperature, top-k or top-p)."""
    stop_reason: str
    """"stop" (stop token or stop string) or "length" (max_tokens reached)."""


@dataclass
class SampleOutput:
    """The completions of one prompt, and its logprobs when they were asked for."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None
    """Per prompt position; None at position 0."""
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None
    """Per prompt position, the k best (token, logprob), best first; None at position 0."""
