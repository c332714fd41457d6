"""Which of PyTorch's attention kernels run where shapes keep changing: SDPA kept off cuDNN, and PyTorch's varlen
flash kernel for rows that hold several sequences (a packed training row, a batch of images in the vision tower)."""

import contextlib
import inspect

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn
from transformers import AttentionInterface, PreTrainedModel

_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# torch.nn.attention.varlen is new and still changing: the call below needs its keyword form with `scale` and
# `window_size` (torch 2.11 has it); torch 2.12 added `enable_gqa`, which it then requires for fewer key/value
# heads than query heads (the flash kernel took them before, unasked, as SDPA's GQA does).
_VARLEN_PARAMETERS = inspect.signature(varlen_attn).parameters
_VARLEN_CALLABLE = {"scale", "window_size"} <= _VARLEN_PARAMETERS.keys()
_VARLEN_ASKS_GQA = "enable_gqa" in _VARLEN_PARAMETERS

VISION_VARLEN_ATTENTION = "varlen_flash"
"""The vision tower's attention where the varlen kernel runs. transformers' Qwen-VL vision blocks make one call over
all of a batch's images, told their bounds by `cu_seqlens`, for an implementation whose name says flash; for any
other they read the images' lengths on the host in every block (a device sync) and make one SDPA call per image: 24
syncs and 360 calls for the 15 new images of an RL micro-batch of the 4B."""


def without_cudnn_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """SDPA calls on `device` kept off cuDNN's backend (a no-op off CUDA). cuDNN builds a plan for every shape it
    has not seen (about 41 ms a call on an H100; benchmarks/RESULTS.md), and a packed row's datums in training
    or a group of prompts prefilled together in sampling bring new shapes all the time. The flags are the
    process's: a thread beside this one may run attention with or without cuDNN meanwhile (speed, not results)."""
    return sdpa_kernel(_NO_CUDNN) if device.type == "cuda" else contextlib.nullcontext()


def varlen_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether PyTorch's varlen flash kernel runs here: a CUDA GPU of compute capability 8.0 or more, bf16 or fp16."""
    return (_VARLEN_CALLABLE and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(device) >= (8, 0))


def varlen_attention(query_1HTD: torch.Tensor, key_1KTD: torch.Tensor, value_1KTD: torch.Tensor,
                     cu_seqlens: torch.Tensor, longest: int, scale: float | None, causal: bool) -> torch.Tensor:
    """One varlen flash call over sequences laid end to end in one row (`cu_seqlens`: int32 [S + 1] on the device,
    where each starts, and the row's end), each attending to itself alone; GQA's K < H heads are taken as they
    are. [1, T, H, D], as transformers' attention functions return it."""
    query_THD, key_TKD, value_TKD = (x[0].transpose(0, 1) for x in (query_1HTD, key_1KTD, value_1KTD))
    gqa = {"enable_gqa": True} if _VARLEN_ASKS_GQA and key_TKD.shape[1] != query_THD.shape[1] else {}
    output_THD = varlen_attn(query_THD, key_TKD, value_TKD, cu_seqlens, cu_seqlens, longest, longest, scale=scale,
                             window_size=(-1, 0) if causal else (-1, -1), **gqa)
    return output_THD[None]


def _vision_varlen_attention(module: torch.nn.Module, query_1HTD: torch.Tensor, key_1HTD: torch.Tensor,
                             value_1HTD: torch.Tensor, attention_mask: None, scaling: float | None = None,
                             cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """A vision block's attention as transformers calls a flash implementation: all of a batch's images in one
    call, each attending to itself alone. The tower is frozen, so no dropout."""
    return varlen_attention(query_1HTD, key_1HTD, value_1HTD, cu_seq_lens_q.to(torch.int32), int(max_length_q),
                            scaling, causal=False), None


AttentionInterface.register(VISION_VARLEN_ATTENTION, _vision_varlen_attention)


def use_varlen_vision_attention(tower: PreTrainedModel) -> bool:
    """Give a vision tower one varlen call per block where that kernel runs on its device and dtype; elsewhere it
    keeps transformers' SDPA. Whether it now has it."""
    parameter = next(tower.parameters())
    if not varlen_runs(parameter.device, parameter.dtype):
        return False
    tower.config._attn_implementation = VISION_VARLEN_ATTENTION  # the config its blocks read
    return True
