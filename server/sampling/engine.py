"""The sampling engine the API calls: the embedded engine, or vLLM with the embedded engine beside it.

Both take the VLLMRenderer's collapsed prompt and the adapter a request was pinned to when it was
accepted (`AdapterRef`). vLLM cannot adapt the unembedding (lm_head), which Tinker trains by
default (train_unembed=True), and runs without LoRA where its kernels lack it (MoE on CPU): the
embedded engine samples those adapters, so every adapter samples the same way whichever engine
serves it. Knows nothing about HTTP, the wire format or the store.
"""

import hashlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from server.rendering.chunks import RenderedInput
from server.sampling.adapters import SamplerAdapters
from server.sampling.embedded import OnDemandSampler
from server.sampling.types import SampleOutput, SamplingOptions
from server.sampling.vllm import VLLMSampler
from server.training.lora import LoraAdapter


@dataclass(frozen=True)
class AdapterRef:
    """The adapter of one sampling request."""

    name: str
    """Unique per version of the weights (a new name after an overwrite): the key of vLLM's caches."""
    directory: Path | None
    """Its PEFT files (saved checkpoints, and snapshots where they are written); None: in memory only."""
    weights: LoraAdapter | None
    """In memory already (snapshots); else loaded from `directory` if the embedded engine needs it."""
    adapts_unembedding: bool


def checkpoint_adapter_name(tinker_path: str, created_at: datetime) -> str:
    """An adapter name per version of a saved checkpoint: an overwrite must never reuse a cached adapter."""
    return "checkpoint-" + hashlib.sha256(f"{tinker_path}@{created_at.isoformat()}".encode()).hexdigest()[:24]


class EmbeddedEngine:
    """HF transformers in this process, one request at a time."""

    workers = 1

    def __init__(self, sampler: OnDemandSampler, adapters: SamplerAdapters):
        self.sampler = sampler
        self.adapters = adapters

    def sample(self, prompt: RenderedInput, options: SamplingOptions, *, adapter: AdapterRef | None, num_samples: int,
               include_prompt_logprobs: bool, topk_prompt_logprobs: int) -> SampleOutput:
        weights = None
        if adapter is not None:
            weights = adapter.weights if adapter.weights is not None else self.adapters.saved(adapter.directory)
        return self.sampler.sample(prompt, options, num_samples=num_samples,
                                   include_prompt_logprobs=include_prompt_logprobs,
                                   topk_prompt_logprobs=topk_prompt_logprobs, adapter=weights)

    def forget(self, name: str) -> None:
        """Nothing to release: the embedded engine holds no adapter of its own."""


class VLLMEngine:
    """vLLM, which batches every request in flight (so many run at once), adapters loaded by path."""

    workers = 64

    def __init__(self, vllm: VLLMSampler, embedded: EmbeddedEngine):
        self.vllm = vllm
        self.embedded = embedded

    def sample(self, prompt: RenderedInput, options: SamplingOptions, *, adapter: AdapterRef | None, num_samples: int,
               include_prompt_logprobs: bool, topk_prompt_logprobs: int) -> SampleOutput:
        serves_adapters = self.vllm.server.config.max_loras > 0
        if adapter is not None and (adapter.adapts_unembedding or adapter.directory is None or not serves_adapters):
            return self.embedded.sample(prompt, options, adapter=adapter, num_samples=num_samples,
                                        include_prompt_logprobs=include_prompt_logprobs,
                                        topk_prompt_logprobs=topk_prompt_logprobs)
        return self.vllm.sample(prompt.token_ids, options, images=[image.png_bytes for image in prompt.images],
                                image_hashes=[image.sha256 for image in prompt.images],
                                adapter=None if adapter is None else (adapter.name, adapter.directory),
                                num_samples=num_samples, include_prompt_logprobs=include_prompt_logprobs,
                                topk_prompt_logprobs=topk_prompt_logprobs)

    def forget(self, name: str) -> None:
        """Unload an adapter whose weights are gone (vLLM would otherwise keep its name forever)."""
        self.vllm.unload_adapter(name)
