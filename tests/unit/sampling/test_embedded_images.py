"""The embedded engine on image prompts: it expands the collapsed prompt itself and decodes with the
family's multimodal rope positions, like transformers' own generate does (with the media
placeholders suppressed: the engine never samples them, and its logprobs are renormalised)."""

import pytest
import torch

from server.config import ImageConfig, ModelConfig
from server.rendering.chunks import render_model_input
from server.sampling.embedded import EmbeddedEngine, load_engine_model
from server.sampling.types import LogprobOptions, SamplingOptions, SamplingRequest
from server.wire.model_input import EncodedTextChunk, ImageChunk, ModelInput

from support.vision import context_for, encode, load, noise_image


@pytest.fixture(scope="module", params=["builtin:tiny-qwen2-vl", "builtin:tiny-qwen3-vl", "builtin:tiny-qwen3.5",
                                        "builtin:tiny-qwen3.5-moe"])
def setup(request, models_dir):
    base = load(request.param, models_dir)  # the reference copy; the engine loads its own
    context = context_for(base, ImageConfig())
    engine = EmbeddedEngine(lambda: load_engine_model(ModelConfig(base_model=request.param, model_path=None,
                                                                  model_cache_dir=models_dir), 1 << 28))
    tokens = base.tokenizer.encode("What is in this picture?")
    vision_start = base.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    vision_end = base.tokenizer.convert_tokens_to_ids("<|vision_end|>")
    chunks = [EncodedTextChunk(tokens=tokens[:2] + [vision_start]),
              ImageChunk(data=encode(noise_image(90, 60)), format="png"),
              EncodedTextChunk(tokens=[vision_end] + tokens[2:])]
    prompt = render_model_input(ModelInput(chunks=chunks), context, "prompt")
    yield base, engine, prompt
    engine.close()


def _hf_inputs(base, prompt):
    input_ids = torch.tensor([prompt.expanded_token_ids()])
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                pixel_values=torch.cat([image.pixel_values for image in prompt.images]),
                image_grid_thw=torch.tensor([image.grid_thw for image in prompt.images]),
                mm_token_type_ids=(input_ids == base.vision.image_token_id).int())


def test_greedy_output_on_an_image_prompt_equals_transformers_generate(setup):
    base, engine, prompt = setup
    out = engine.sample(SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=10, temperature=0.0)))
    inputs = _hf_inputs(base, prompt)
    generated = base.model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                                    suppress_tokens=sorted(base.vision.reserved_token_ids))
    assert out.sequences[0].tokens == generated[0, inputs["input_ids"].shape[1]:].tolist()


def test_prompt_and_sampled_logprobs_equal_a_full_forward_with_pixel_values(setup):
    base, engine, prompt = setup
    out = engine.sample(SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=6, seed=3), num_samples=2,
                                        logprobs=LogprobOptions(prompt_logprobs=True)))
    expanded = prompt.expanded_token_ids()
    assert len(out.prompt_logprobs) == prompt.num_positions == len(expanded)
    assert out.prompt_logprobs[0] is None
    for sequence in out.sequences:
        inputs = _hf_inputs(base, prompt)
        full = torch.tensor([expanded + sequence.tokens])
        inputs.update(input_ids=full, attention_mask=torch.ones_like(full),
                      mm_token_type_ids=(full == base.vision.image_token_id).int())
        reserved = torch.tensor(sorted(base.vision.reserved_token_ids))
        with torch.no_grad():
            logits = base.model(**inputs).logits[0].float()
        logprobs = logits.index_fill(-1, reserved, float("-inf")).log_softmax(-1)
        targets = full[0, 1:]
        # An image's positions are given, not predicted: logprob 0.
        per_token = logprobs[:-1].gather(-1, targets[:, None])[:, 0].masked_fill(torch.isin(targets, reserved), 0.0)
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), per_token[:len(expanded) - 1],
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(sequence.logprobs), per_token[len(expanded) - 1:], atol=1e-4, rtol=0)
