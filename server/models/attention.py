"""The attention implementation every model here loads with: PyTorch's SDPA, given additive masks.

On CUDA, SDPA runs cuDNN attention, which builds a plan for each new shape it sees with a boolean mask
(about 46 ms a call for a decode step, 120 ms for a 1,000-token training row with its backward; measured on
the H100, benchmarks/RESULTS.md) but not with an additive one (0.1 and 1.5 ms). The sampler's decode
steps and the trainer's padded micro-batches change shape all the time, so the masks that transformers
builds for SDPA (boolean, or none where the batch needs none) are handed over as 0 / dtype-minimum biases.
"""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "sdpa_additive"
"""The `attn_implementation` models are loaded with."""


def additive_sdpa_mask(*args, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask (None where causal attention needs none), as a bias of the model's dtype."""
    mask = sdpa_mask(*args, **kwargs)
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask.bool(), torch.finfo(dtype).min)


AttentionInterface.register(ATTENTION, sdpa_attention_forward)
AttentionMaskInterface.register(ATTENTION, additive_sdpa_mask)
