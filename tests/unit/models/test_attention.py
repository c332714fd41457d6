"""SDPA kept off cuDNN where shapes keep changing (prefill groups, packed rows): the flag is off inside and as
it was after, on CUDA devices only (the flags are PyTorch's own, readable without a GPU). The vision tower's varlen
attention is for CUDA GPUs alone (tests/gpu/test_vision_varlen_gpu.py checks it there)."""

import torch

from server.config import ModelConfig
from server.models.attention import use_varlen_vision_attention, varlen_runs, without_cudnn_attention
from server.models.loading import load_base_model


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


def test_a_vision_tower_off_a_cuda_gpu_keeps_transformers_sdpa(models_dir):
    base = load_base_model(ModelConfig(base_model="builtin:tiny-qwen2-vl", model_path=None, model_cache_dir=models_dir))
    tower = base.model.get_submodule(base.family.vision.tower_module)
    assert tower.config._attn_implementation == "sdpa"
    assert not use_varlen_vision_attention(tower)
    assert tower.config._attn_implementation == "sdpa"
    assert not varlen_runs(torch.device("cpu"), torch.bfloat16)
