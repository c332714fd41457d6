"""How the embedded sampling engine draws tokens: each row's temperature, top-k and top-p, then one uniform
number per row through the inverse of its distribution's CDF; the k best alternatives; draws at prompt
positions. Pure functions of logits and random numbers: they know nothing of batches, requests'
lifetimes or models.

Tensor shape suffixes: R  rows drawn together   C  a chunk of prompt positions   V  vocabulary
K  draws per row
"""

import torch

from server.sampling.types import TopkRows


def seeded_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """A generator on `device` with this seed (None: a fresh random one)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def best_alternatives(logprobs_GV: torch.Tensor, k: int) -> TopkRows:
    """The k most likely (token, logprob) of each row, best first (never a refused id)."""
    values_GK, tokens_GK = logprobs_GV.topk(min(k, logprobs_GV.shape[-1]), dim=-1)
    return [[(t, v) for t, v in zip(tokens, values) if v != float("-inf")]
            for tokens, values in zip(tokens_GK.tolist(), values_GK.tolist())]


def draw(logprobs_CV: torch.Tensor, temperature: float, num_draws: int, generator: torch.Generator) -> torch.Tensor:
    """num_draws tokens per row, with replacement, at `temperature` (0: the most likely, every time)."""
    if temperature == 0:
        return logprobs_CV.argmax(dim=-1, keepdim=True).expand(-1, num_draws).contiguous()
    return torch.multinomial((logprobs_CV / temperature).softmax(dim=-1), num_draws, replacement=True,
                             generator=generator)


def sample_tokens(logits_RV: torch.Tensor, temperature_R: torch.Tensor, top_k_R: torch.Tensor,
                  top_p_R: torch.Tensor, uniform_R: torch.Tensor, *, widest_top_k: int,
                  any_top_p: bool) -> torch.Tensor:
    """Draw one token per row from its filtered distribution, at its uniform number (temperature 0: the argmax).

    Every row of a decode step is drawn in one pass, whatever request it belongs to: the per-row settings
    are tensors, and each sample's uniform numbers come from a generator of its own (the engine keeps one
    per sample), so a sample's tokens depend only on its seed and step, never on its neighbours or on when
    it joined.

    Args:
        top_k_R: k of each row; 0 or -1 (or the vocabulary's size) keeps every token.
        uniform_R: each row's number in [0, 1), from its sample's own stream.
        widest_top_k, any_top_p: what the caller knows of the rows' settings on the host (the largest k that
            limits a row, 0 if none does; whether a row's top_p is below 1), so that no step waits on the device
            to find out.
    """
    greedy_R = temperature_R == 0
    probs_RV = filtered_probs(logits_RV, torch.where(greedy_R, 1.0, temperature_R), top_k_R, top_p_R,
                              widest_top_k, any_top_p)
    # Inverse CDF: the first token whose cumulative mass passes u * total. A token of probability 0 is
    # never picked: the search point stays below the total and a flat step of the CDF is never the first
    # index that passes it.
    cdf_RV = probs_RV.cumsum(dim=-1)
    total_R1 = cdf_RV[:, -1:]
    point_R1 = torch.minimum(uniform_R.to(cdf_RV.dtype)[:, None] * total_R1,
                             torch.nextafter(total_R1, torch.zeros_like(total_R1)))
    tokens_R = torch.searchsorted(cdf_RV, point_R1, right=True)[:, 0]
    return torch.where(greedy_R, logits_RV.argmax(dim=-1), tokens_R)


def filtered_probs(logits_RV: torch.Tensor, temperature_R: torch.Tensor, top_k_R: torch.Tensor,
                   top_p_R: torch.Tensor, widest_top_k: int, any_top_p: bool) -> torch.Tensor:
    """Apply each row's temperature, then its top-k, then its top-p, and return the sampling distributions."""
    scaled_RV = logits_RV / temperature_R[:, None]
    if widest_top_k:
        limited_R = (top_k_R > 0) & (top_k_R < scaled_RV.shape[-1])
        kth_R1 = scaled_RV.topk(widest_top_k, dim=-1).values.gather(-1, (top_k_R.clamp(1, widest_top_k) - 1)[:, None])
        scaled_RV = scaled_RV.masked_fill(limited_R[:, None] & (scaled_RV < kth_R1), float("-inf"))
    if any_top_p:
        sorted_RV, order_RV = scaled_RV.sort(dim=-1, descending=True)
        sorted_probs_RV = sorted_RV.softmax(dim=-1)
        # Drop a token once the better tokens already hold top_p of the mass; the best always stays.
        drop_RV = sorted_probs_RV.cumsum(dim=-1) - sorted_probs_RV >= top_p_R[:, None]
        scaled_RV = scaled_RV.scatter(-1, order_RV, sorted_RV.masked_fill(drop_RV, float("-inf")))
    return scaled_RV.softmax(dim=-1)
