"""Which of PyTorch's attention kernels run where shapes keep changing."""

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def without_cudnn_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """SDPA calls on `device` kept off cuDNN's backend (a no-op off CUDA). cuDNN builds a plan for every shape it
    has not seen (about 41 ms a call on an H100; benchmarks/RESULTS.md), and a packed row's datums in training
    or a group of prompts prefilled together in sampling bring new shapes all the time. The flags are the
    process's: a thread beside this one may run attention with or without cuDNN meanwhile (speed, not results)."""
    return sdpa_kernel(_NO_CUDNN) if device.type == "cuda" else contextlib.nullcontext()
