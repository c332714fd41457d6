"""The output distribution that the trainer and every sampling engine share.

Token ids the server refuses as input (the media placeholders: an image enters a sequence only
through an image chunk) get zero probability: they are masked before sampling, and every logprob
the server reports, the trainer's included, is of that renormalised distribution. A target that is
itself a refused id (an image position) is never predicted, only given, so its logprob is 0.
A model without refused ids keeps the plain log-softmax. Knows nothing about LoRA or requests.

Shapes: N = positions, V = vocabulary, K = targets per position, M = refused ids.
"""

import torch


def refused_ids_tensor(refused_token_ids, device: torch.device | str) -> torch.Tensor:
    """The refused ids as the int64 tensor the functions below take."""
    return torch.tensor(sorted(refused_token_ids), dtype=torch.long, device=device)


def refused_mask(refused_M: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """bool [V]: True at the refused ids."""
    return torch.zeros(vocabulary, dtype=torch.bool, device=refused_M.device).index_fill_(0, refused_M, True)


def mask_refused(logits_NV: torch.Tensor, refused_M: torch.Tensor,
                 refused_V: torch.Tensor | None = None) -> torch.Tensor:
    """The logits with -inf at the refused ids (unchanged when there are none); `refused_V`: their
    `refused_mask`, when the caller keeps one."""
    if refused_M.numel() == 0:
        return logits_NV
    # An element-wise mask, not an index_fill: compiled, it fuses into whatever reads the logits next,
    # instead of writing a masked copy of them first.
    if refused_V is None:
        refused_V = refused_mask(refused_M.to(logits_NV.device), logits_NV.shape[-1])
    return logits_NV.masked_fill(refused_V, float("-inf"))


def renormalised_logprobs(logits_NV: torch.Tensor, refused_M: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities [N, V] of the renormalised distribution (-inf at the refused ids)."""
    return torch.log_softmax(mask_refused(logits_NV.float(), refused_M), dim=-1)


def target_logprobs(logits_NV: torch.Tensor, targets_NK: torch.Tensor, refused_M: torch.Tensor) -> torch.Tensor:
    """fp32 log p(target) [N, K] under the renormalised distribution; 0 where the target is refused."""
    logprobs_NK = renormalised_logprobs(logits_NV, refused_M).gather(-1, targets_NK)
    return zero_refused_targets(logprobs_NK, targets_NK, refused_M)


def zero_refused_targets(values_NK: torch.Tensor, targets_NK: torch.Tensor, refused_M: torch.Tensor) -> torch.Tensor:
    """`values_NK` with 0 where the target is refused (its logprob is a constant 0, its gradient none)."""
    if refused_M.numel() == 0:
        return values_NK
    return torch.where(torch.isin(targets_NK, refused_M), 0.0, values_NK)
