"""How the embedded sampling engine draws tokens: temperature, top-k and top-p, then an exponential race
with one generator per sample; the k best alternatives; draws at prompt positions.

Pure functions of logits and generators: they know nothing of batches, requests' lifetimes or models.

Tensor shape suffixes: G  rows of one request   C  a chunk of prompt positions   V  vocabulary
K  draws per row
"""

import torch

from server.sampling.types import SamplingOptions, TopkRows


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


def sample_tokens(logits_GV: torch.Tensor, options: SamplingOptions,
                   generators: list[torch.Generator]) -> torch.Tensor:
    """Draw one token for each of a request's rows, each row with its sample's own generator."""
    if options.temperature == 0:
        return logits_GV.argmax(dim=-1)
    probs_GV = filtered_probs(logits_GV, options)
    # Exponential race (argmax of p / q, q ~ Exp(1)) draws from probs_GV, as vLLM does. Each row
    # draws its noise from its own generator, so a sample's draws depend only on its seed and step,
    # never on its siblings or on when it joined; the clamp keeps q = 0 from producing inf or nan.
    noise_GV = torch.empty_like(probs_GV)
    for noise_V, generator in zip(noise_GV, generators):
        noise_V.exponential_(generator=generator)
    return (probs_GV / noise_GV.clamp_min(torch.finfo(noise_GV.dtype).tiny)).argmax(dim=-1)


def filtered_probs(logits_GV: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p, and return the sampling distribution."""
    scaled_GV = logits_GV / options.temperature
    if 0 < options.top_k < scaled_GV.shape[-1]:
        kth_G1 = scaled_GV.topk(options.top_k, dim=-1).values[:, -1:]
        scaled_GV = scaled_GV.masked_fill(scaled_GV < kth_G1, float("-inf"))
    if options.top_p < 1:
        sorted_GV, order_GV = scaled_GV.sort(dim=-1, descending=True)
        sorted_probs_GV = sorted_GV.softmax(dim=-1)
        # Drop a token once the better tokens already hold top_p of the mass; the best always stays.
        drop_GV = sorted_probs_GV.cumsum(dim=-1) - sorted_probs_GV >= options.top_p
        scaled_GV = scaled_GV.scatter(-1, order_GV, sorted_GV.masked_fill(drop_GV, float("-inf")))
    return scaled_GV.softmax(dim=-1)
