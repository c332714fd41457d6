"""Packed micro-batches: a micro-batch's datums laid end to end in one row, no padding, each datum
attending to itself alone.

The row goes through the HF model with rope positions restarting at each datum and no padding mask;
the decoder's attention (`apply_segment_attention`) then runs SDPA once per datum, causal, told where
the datums end by the `segment_lengths` keyword: no [N, N] block-diagonal mask is built, no position
attends across datums, and on a GPU each call takes PyTorch's flash kernel, which needs no per-length
plan. Padded rows (a padding mask given) run exactly as transformers' own SDPA runs them. Knows
nothing about losses, adapters or ranks.

Shapes: B = rows, H = heads, T = positions of a row, D = head size, S = datums of a packed row.
"""

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SEGMENT_ATTENTION = "segment_sdpa"
"""The name this attention goes by in transformers' registries (the text config's attn implementation)."""

# cuDNN's attention builds a plan per new sequence length (~0.1 s per layer the first time on an H100);
# a packed row's datums bring new lengths all the time.
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@torch.compiler.disable  # the datums' lengths are read on the host: a compiled block breaks its graph here
def segment_attention(module: torch.nn.Module, query_BHTD: torch.Tensor, key_BHTD: torch.Tensor,
                      value_BHTD: torch.Tensor, attention_mask: torch.Tensor | None,
                      segment_lengths: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, or with `segment_lengths` (int64 [S] on the host) one causal SDPA
    per datum of a packed row; the output is [B, T, H, D] either way."""
    if segment_lengths is None:
        return sdpa_attention_forward(module, query_BHTD, key_BHTD, value_BHTD, attention_mask, **kwargs)
    lengths = segment_lengths.tolist()
    with sdpa_kernel(_NO_CUDNN) if query_BHTD.is_cuda else contextlib.nullcontext():
        pieces = [sdpa_attention_forward(module, query, key, value, None, **kwargs)[0]
                  for query, key, value in zip(query_BHTD.split(lengths, 2), key_BHTD.split(lengths, 2),
                                               value_BHTD.split(lengths, 2))]
    return torch.cat(pieces, dim=1), None


def _segment_mask(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """A packed row (no padding mask) needs no mask at all: each datum is a causal call of its own."""
    return None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kwargs)


AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
AttentionMaskInterface.register(SEGMENT_ATTENTION, _segment_mask)


def apply_segment_attention(model: PreTrainedModel) -> None:
    """Give the language model's attention layers `segment_attention` (the vision tower keeps its own)."""
    model.config.get_text_config()._attn_implementation = SEGMENT_ATTENTION


def pack_first_fit(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` in bins of at most `budget` tokens in all (one longer alone), first fit in
    decreasing order of length: few bins, nearly full."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        fits = next((b for b, left in enumerate(room) if lengths[index] <= left), None)
        if fits is None:
            bins.append([index])
            room.append(budget - lengths[index])
        else:
            bins[fits].append(index)
            room[fits] -= lengths[index]
    return bins
