"""The embedded engine on image prompts: it expands the collapsed prompt itself and decodes with the
family's multimodal rope positions, like transformers' own generate does."""

import pytest
import torch

from server.config import ImageConfig
from server.models.vision_features import VisionEncoder
from server.rendering.chunks import render_model_input
from server.sampling.embedded import EmbeddedSampler, SamplingOptions
from server.wire.types import EncodedTextChunk, ImageChunk, ModelInput

from support.vision import context_for, encode, load, noise_image


@pytest.fixture(scope="module", params=["builtin:tiny-qwen2-vl", "builtin:tiny-qwen3-vl"])
def setup(request, models_dir):
    base = load(request.param, models_dir)
    context = context_for(base, ImageConfig())
    encoder = VisionEncoder(base.model, 1 << 28)
    sampler = EmbeddedSampler(base.model, base.tokenizer, vision=base.vision, vision_encoder=encoder)
    tokens = base.tokenizer.encode("What is in this picture?")
    vision_start = base.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    vision_end = base.tokenizer.convert_tokens_to_ids("<|vision_end|>")
    chunks = [EncodedTextChunk(tokens=tokens[:2] + [vision_start]),
              ImageChunk(data=encode(noise_image(90, 60)), format="png"),
              EncodedTextChunk(tokens=[vision_end] + tokens[2:])]
    prompt = render_model_input(ModelInput(chunks=chunks), context, "prompt")
    return base, sampler, prompt


def _hf_inputs(base, prompt):
    input_ids = torch.tensor([prompt.expanded_token_ids()])
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                pixel_values=torch.cat([image.pixel_values for image in prompt.images]),
                image_grid_thw=torch.tensor([image.grid_thw for image in prompt.images]),
                mm_token_type_ids=(input_ids == base.vision.image_token_id).int())


def test_greedy_output_on_an_image_prompt_equals_transformers_generate(setup):
    base, sampler, prompt = setup
    out = sampler.sample(prompt, SamplingOptions(max_tokens=10, temperature=0.0))
    inputs = _hf_inputs(base, prompt)
    generated = base.model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.sequences[0].tokens == generated[0, inputs["input_ids"].shape[1]:].tolist()


def test_prompt_and_sampled_logprobs_equal_a_full_forward_with_pixel_values(setup):
    base, sampler, prompt = setup
    out = sampler.sample(prompt, SamplingOptions(max_tokens=6, seed=3), num_samples=2, include_prompt_logprobs=True)
    expanded = prompt.expanded_token_ids()
    assert len(out.prompt_logprobs) == prompt.num_positions == len(expanded)
    assert out.prompt_logprobs[0] is None
    for sequence in out.sequences:
        inputs = _hf_inputs(base, prompt)
        full = torch.tensor([expanded + sequence.tokens])
        inputs.update(input_ids=full, attention_mask=torch.ones_like(full),
                      mm_token_type_ids=(full == base.vision.image_token_id).int())
        with torch.no_grad():
            logprobs = base.model(**inputs).logits[0].float().log_softmax(-1)
        per_token = logprobs[:-1].gather(-1, full[0, 1:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), per_token[:len(expanded) - 1],
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(sequence.logprobs), per_token[len(expanded) - 1:], atol=1e-4, rtol=0)
