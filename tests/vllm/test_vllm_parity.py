"""vLLM's logprobs equal HF transformers' teacher-forced logprobs (fp32), for text and image prompts.

This is the sampler/trainer consistency the RL losses rely on: a token sampled by vLLM must have
the logprob that the trainer computes for it, image tokens included (both with the placeholders
masked). Prompt logprobs come from the engine without LoRA: with LoRA they are not vLLM's to serve.
"""

import pytest
import torch
from hf_reference import (
    expand_image_pads,
    image_inputs,
    load_model,
    noise_image,
    png_bytes,
    teacher_forced_logprobs,
)

from server.sampling.types import SamplingOptions

TEXT_PROMPT = "<|im_start|>user\nDescribe the picture in one word.<|im_end|>\n<|im_start|>assistant\n"
IMAGE_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and"
                "<|vision_start|><|image_pad|><|vision_end|>Which is brighter?<|im_end|>\n<|im_start|>assistant\n")
# Sizes already on the processor's grid (multiples of 28 for Qwen2-VL, 32 for Qwen3-VL) and inside its
# min/max pixels, so resizing is the identity on both sides; noise makes any pixel difference show.
IMAGE_SIZES = {"qwen2-vl": [(56, 84), (112, 56)], "qwen3-vl": [(256, 256), (320, 256)]}


def assert_close(got: list[float], expected: torch.Tensor) -> None:
    diff = (torch.tensor(got, dtype=torch.float64) - expected.double()).abs()
    assert float(diff.mean()) < 1e-4 and float(diff.max()) < 1e-3, f"mean {diff.mean():.2e}, max {diff.max():.2e}"


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    return {family: load_model(path) for family, path in model_dirs.items()}


@pytest.mark.parametrize("with_images", [False, True], ids=["text", "two-images"])
def test_sampled_and_prompt_logprobs_equal_hf_teacher_forcing(engine, hf_models, with_images):
    hf_model = hf_models[engine.family]
    prompt = engine.encode(IMAGE_PROMPT if with_images else TEXT_PROMPT)
    pil_images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(IMAGE_SIZES[engine.family])] if with_images else []
    scores_prompt = engine.server.config.max_loras == 0
    out = engine.sample(prompt, SamplingOptions(max_tokens=12, temperature=1.0, seed=5),
                        images=[png_bytes(image) for image in pil_images], num_samples=2, prompt_logprobs=scores_prompt)

    images = image_inputs(engine.model_dir, pil_images) if with_images else None
    expanded = prompt
    if with_images:
        expanded = expand_image_pads(prompt, engine.token_id("<|image_pad|>"), images["image_grid_thw"])
        assert len(expanded) > len(prompt) + 10
    if scores_prompt:
        # One prompt logprob per position of vLLM's expanded prompt, None first; image pads included (0).
        assert len(out.prompt_logprobs) == len(expanded) and out.prompt_logprobs[0] is None
        assert_close(out.prompt_logprobs[1:], teacher_forced_logprobs(hf_model, expanded, images)[1:])
    for sequence in out.sequences:
        expected = teacher_forced_logprobs(hf_model, expanded + sequence.tokens, images)[len(expanded):]
        assert_close(sequence.logprobs, expected)


def test_an_image_changes_the_logprobs_and_its_pixels_matter(qwen3_vl):
    # Guards the test above against an engine that ignored the images.
    prompt = qwen3_vl.encode(IMAGE_PROMPT)
    options = SamplingOptions(max_tokens=1)
    first = [png_bytes(noise_image(w, h, seed=i)) for i, (w, h) in enumerate(IMAGE_SIZES["qwen3-vl"])]
    second = [png_bytes(noise_image(w, h, seed=i + 10)) for i, (w, h) in enumerate(IMAGE_SIZES["qwen3-vl"])]
    a = qwen3_vl.sample(prompt, options, images=first, prompt_logprobs=True).prompt_logprobs
    b = qwen3_vl.sample(prompt, options, images=second, prompt_logprobs=True).prompt_logprobs
    assert len(a) == len(b)
    assert max(abs(x - y) for x, y in zip(a[-5:], b[-5:])) > 1e-4
