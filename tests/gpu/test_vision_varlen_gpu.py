"""On a CUDA device in bf16 (`pytest -m gpu tests/gpu/test_vision_varlen_gpu.py`): the vision tower of every
vision-language family loads with one varlen flash call per block over all of a batch's images, and its features
are those of transformers' per-image SDPA within bf16 rounding.

Stated tolerance: the features stray from an fp32 reference (the same weights in fp32, per-image SDPA) at most twice
as far as the bf16 per-image SDPA path's own, plus 1e-3 (FlashAttention's own test rule); an image that attended to
another would stray by the size of the features."""

import pytest
import torch

from server.config import ImageConfig, ModelConfig
from server.models import attention
from server.models.image_processor import ImageProcessorSpec
from server.models.loading import load_base_model
from server.rendering.images import ImagePreparer

from support.vision import encode, noise_image

pytestmark = pytest.mark.gpu

SIZES = [(448, 448), (200, 120), (57, 333)]  # images of different patch counts in one batch


def _features(base, images) -> torch.Tensor:
    device = next(base.model.parameters()).device
    pixel_values = torch.cat([image.pixel_values_on(device) for image in images]).to(base.model.dtype)
    grid_thw = torch.tensor([image.grid_thw for image in images], device=device)
    with torch.no_grad():
        output = base.model.model.get_image_features(pixel_values, grid_thw, return_dict=True)
    return torch.cat(list(output.pooler_output)).float()


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3.5"])
def test_the_vision_tower_takes_one_varlen_call_per_block_and_gives_sdpa_s_features(name, models_dir, monkeypatch):
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device")
    config = dict(base_model=f"builtin:{name}", model_path=None, model_cache_dir=models_dir, device="cuda")
    reference_base = load_base_model(ModelConfig(**config, dtype="float32"))
    base = load_base_model(ModelConfig(**config, dtype="bfloat16"))
    tower = base.model.get_submodule(base.family.vision.tower_module)
    assert tower.config._attn_implementation == attention.VISION_VARLEN_ATTENTION
    assert reference_base.model.get_submodule(base.family.vision.tower_module).config._attn_implementation == "sdpa"

    preparer = ImagePreparer(ImageProcessorSpec.from_model_dir(base.path), ImageConfig())
    images = [preparer.prepare(encode(noise_image(*size, seed=size[0])), "x") for size in SIZES]
    calls = []
    one_call = attention.varlen_attention
    monkeypatch.setattr(attention, "varlen_attention", lambda *a, **k: calls.append(1) or one_call(*a, **k))
    varlen = _features(base, images)
    assert len(calls) == len(tower.blocks)  # one call per block for all three images
    tower.config._attn_implementation = "sdpa"
    per_image = _features(base, images)
    reference = _features(reference_base, images)
    worst, allowed = (varlen - reference).abs().max().item(), 2 * (per_image - reference).abs().max().item() + 1e-3
    print(f"{name}: varlen {worst:.2e}, per-image sdpa {(per_image - reference).abs().max().item():.2e}")
    assert worst <= allowed
