"""SDPA kept off cuDNN where shapes keep changing (prefill groups, packed rows): the flag is off inside and as
it was after, on CUDA devices only (the flags are PyTorch's own, readable without a GPU)."""

import torch

from server.models.attention import without_cudnn_attention


def test_cudnn_attention_is_off_inside_on_cuda_and_as_it_was_after():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with without_cudnn_attention(torch.device("cuda", 0)):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_other_devices_are_left_alone():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with without_cudnn_attention(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
