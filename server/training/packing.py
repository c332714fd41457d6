"""Packed micro-batches: a micro-batch's datums laid end to end in one row, no padding, each datum
attending to itself alone.

The row goes through the HF model with rope positions restarting at each datum and no padding mask;
the decoder's attention (`apply_segment_attention`) is told where the datums end by the
`segment_lengths` keyword and keeps each datum to itself: no [N, N] block-diagonal mask is built and
no position attends across datums. Where PyTorch's varlen flash kernel runs (`packed_attention`), the
row takes ONE causal varlen call per layer, told the datums' boundaries by `cu_seqlens` (built once
per micro-batch); elsewhere (CPU, fp32) one causal SDPA call per datum. Padded rows (a padding mask
given) run exactly as transformers' own SDPA runs them. Knows nothing about losses, adapters or ranks.

Shapes: B = rows, H = heads (K of them for keys and values under GQA), T = positions of a row, D = head
size, S = datums of a packed row.
"""

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from server.models.attention import varlen_attention, varlen_runs, without_cudnn_attention

SEGMENT_ATTENTION = "segment_sdpa"
"""The name this attention goes by in transformers' registries (the text config's attn implementation)."""


def packed_attention(setting: str, device: torch.device, dtype: torch.dtype) -> str:
    """`varlen` or `sdpa`, the attention of packed rows for --packed-attention `setting`: auto is varlen
    where PyTorch's varlen flash kernel runs (a CUDA GPU of compute capability 8.0 or more, bf16 or fp16),
    else sdpa; varlen where it cannot run is refused."""
    runs = varlen_runs(device, dtype)
    if setting == "varlen" and not runs:
        raise ValueError(f"--packed-attention varlen needs PyTorch's varlen flash kernel (torch {torch.__version__}"
                         f"), a CUDA GPU of compute capability 8.0 or more and bf16 or fp16; here {device}, {dtype}")
    return "varlen" if runs and setting != "sdpa" else "sdpa"


def cumulative_lengths(segment_lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Where each datum of a packed row starts, and the row's end: int32 [S + 1] on `device` (varlen's cu_seqlens)."""
    return torch.nn.functional.pad(segment_lengths.cumsum(0), (1, 0)).to(device, torch.int32)


@torch.compiler.disable  # the datums' lengths are read on the host: a compiled block breaks its graph here
def segment_attention(module: torch.nn.Module, query_BHTD: torch.Tensor, key_BHTD: torch.Tensor,
                      value_BHTD: torch.Tensor, attention_mask: torch.Tensor | None,
                      segment_lengths: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, or with `segment_lengths` (int64 [S] on the host) a packed row's: one
    causal varlen call given `cu_seqlens` (`cumulative_lengths`), else one causal SDPA per datum; the output
    is [B, T, H, D] either way."""
    if segment_lengths is None:
        return sdpa_attention_forward(module, query_BHTD, key_BHTD, value_BHTD, attention_mask, **kwargs)
    if cu_seqlens is not None:
        return varlen_attention(query_BHTD, key_BHTD, value_BHTD, cu_seqlens, int(segment_lengths.max()),
                                kwargs.get("scaling"), causal=True), None
    lengths = segment_lengths.tolist()
    with without_cudnn_attention(query_BHTD.device):
        pieces = [sdpa_attention_forward(module, query, key, value, None, **kwargs)[0]
                  for query, key, value in zip(query_BHTD.split(lengths, 2), key_BHTD.split(lengths, 2),
                                               value_BHTD.split(lengths, 2))]
    return torch.cat(pieces, dim=1), None


def _segment_mask(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """A packed row (no padding mask) needs no mask at all: its attention keeps each datum to itself."""
    return None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kwargs)


AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
AttentionMaskInterface.register(SEGMENT_ATTENTION, _segment_mask)


def apply_segment_attention(model: PreTrainedModel) -> None:
    """Give the language model's attention layers `segment_attention` (the vision tower keeps its own)."""
    model.config.get_text_config()._attn_implementation = SEGMENT_ATTENTION


def pack_balanced(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` in bins of at most `budget` tokens in all (one longer alone): as many bins as first
    fit in decreasing order of length fills, their tokens as even as the lengths allow.

    Even, because a micro-batch costs at least the host's time to launch its kernels (about 0.36 s for a 4B
    forward and backward on an H200 host): 10,000 tokens as 8,192 + 1,808 cost two full micro-batches' time
    where 5,000 + 5,000 cost little more than their tokens.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    first_fit = _first_fit(lengths, order, budget)
    bins: list[list[int]] = [[] for _ in first_fit]
    load = [0] * len(bins)
    for index in order:  # longest first into the emptiest bin, the one it fits if any does
        emptiest = load.index(min(load))
        if bins[emptiest] and load[emptiest] + lengths[index] > budget:
            return first_fit
        bins[emptiest].append(index)
        load[emptiest] += lengths[index]
    return bins


def _first_fit(lengths: list[int], order: list[int], budget: int) -> list[list[int]]:
    """Indices in `order` in bins of at most `budget` tokens (one longer alone), each into the first with room."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in order:
        fits = next((b for b, left in enumerate(room) if lengths[index] <= left), None)
        if fits is None:
            bins.append([index])
            room.append(budget - lengths[index])
        else:
            bins[fits].append(index)
            room[fits] -= lengths[index]
    return bins
