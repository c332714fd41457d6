"""The variants: vLLM's own model class, plus LoRA on lm_head and masked media placeholders.

- LoRA on lm_head: vLLM wraps a model's lm_head with LogitsProcessorWithLoRA only where the model
  class lists "lm_head" in `embedding_modules`; its Qwen-VL (and Qwen2) classes do not.
- Masked placeholders: the token ids in the config's `tinker_masked_token_ids` (the server's media
  placeholders, which it refuses as input) get logit -inf in `compute_logits`, so they are never
  sampled and every logprob vLLM returns (raw_logprobs) is of the renormalised distribution the
  sampler used, as the server's trainer computes it.
"""

import importlib

import torch

from tinker_vllm_plugin import ARCHITECTURES, PREFIX


def _variant(base: type) -> type:
    class Variant(base):
        embedding_modules = {**getattr(base, "embedding_modules", {}), "lm_head": "output_embeddings"}

        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            masked = getattr(vllm_config.model_config.hf_config, "tinker_masked_token_ids", None) or []
            self.tinker_masked_token_ids = torch.tensor(sorted(masked), dtype=torch.long)

        def compute_logits(self, hidden_states: torch.Tensor):
            logits = super().compute_logits(hidden_states)
            # None on tensor-parallel ranks other than the one that gathers the logits.
            if logits is not None and len(self.tinker_masked_token_ids):
                logits = logits.index_fill(-1, self.tinker_masked_token_ids.to(logits.device), float("-inf"))
            return logits

    Variant.__name__ = Variant.__qualname__ = PREFIX + base.__name__
    return Variant


def __getattr__(name: str) -> type:
    for architecture, module in ARCHITECTURES:
        if name == PREFIX + architecture:
            variant = _variant(getattr(importlib.import_module(module), architecture))
            globals()[name] = variant
            return variant
    raise AttributeError(name)
