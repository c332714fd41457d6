"""What every sampling engine must do through the real SDK; shared by the embedded engine's SDK tests and vLLM's.

- Isolation: two runs on one server (one trained far from the base, one fresh) sample at once, many
  concurrent requests each, text and image prompts, several samples per request; every sampled
  token's logprob equals its own run's trainer `forward` (fp32, max |diff| under 1e-3), and differs
  from what the other run's weights give.
- The image limit: a prompt with one image too many is a 400 that names the limit.
"""

import numpy as np
import pytest
import tinker
from tinker import types

from support.sdk import forward_logprobs
from support.vision_sdk import ImagePrompts, noise

FAR = types.AdamParams(learning_rate=5e-2)


def image_prompts(prompts: ImagePrompts) -> list[list]:
    return [prompts.user_turn([noise(64, 64, seed=1)], "What is in the picture?"),
            prompts.user_turn([], "Tell me about shapes."),
            prompts.user_turn([noise(90, 60, seed=2), noise(60, 90, seed=3)], "Which one is brighter?")]


def continuation(prompt_chunks: list, tokens: list[int]) -> types.Datum:
    """The prompt plus a sampled completion, with the completion as targets."""
    prompt_length = types.ModelInput(chunks=prompt_chunks).length
    model_input = types.ModelInput(chunks=prompt_chunks + [types.EncodedTextChunk(tokens=tokens[:-1])])
    targets = [0] * (prompt_length - 1) + tokens
    return types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": targets,
                                                                "weights": [1.0] * len(targets)})


def check_concurrent_runs_sample_with_their_own_adapters(service, base_model: str, *, train_unembed: bool,
                                                         requests_per_run: int = 16) -> None:
    runs = {name: service.create_lora_training_client(base_model=base_model, rank=8, seed=seed,
                                                      train_unembed=train_unembed).result()
            for name, seed in [("trained", 1), ("fresh", 2)]}
    prompts = ImagePrompts(runs["trained"])
    chunks = image_prompts(prompts)
    data = [prompts.datum(prompt, "Noise, mostly.") for prompt in chunks]
    for _ in range(4):
        runs["trained"].forward_backward(data, "cross_entropy").result()
        runs["trained"].optim_step(FAR).result()
    # One run samples through a saved checkpoint (loaded by path), the other through a snapshot.
    samplers = {"trained": service.create_sampling_client(
                    model_path=runs["trained"].save_weights_for_sampler(f"isolation-{train_unembed}").result().path
                ).result(),
                "fresh": runs["fresh"].save_weights_and_get_sampling_client().result()}

    pending = []
    for index in range(requests_per_run):
        for name, sampler in samplers.items():
            prompt = chunks[index % len(chunks)]
            params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=index, stop=[])
            pending.append((name, prompt, sampler.sample(types.ModelInput(chunks=prompt), num_samples=2,
                                                         sampling_params=params)))
    samples = {name: [] for name in runs}
    for name, prompt, future in pending:
        for sequence in future.result().sequences:
            samples[name].append((prompt, sequence))

    for name, own in samples.items():
        other = runs["fresh" if name == "trained" else "trained"]
        data = [continuation(prompt, sequence.tokens) for prompt, sequence in own]
        sampled = np.concatenate([np.asarray(sequence.logprobs, dtype=np.float64) for _, sequence in own])
        tails = [len(sequence.tokens) for _, sequence in own]
        own_view = np.concatenate([lp[-n:] for lp, n in zip(forward_logprobs(runs[name], data), tails)])
        other_view = np.concatenate([lp[-n:] for lp, n in zip(forward_logprobs(other, data), tails)])
        difference = np.abs(sampled - own_view)
        assert difference.max() < 1e-3, f"{name}: sampler vs its own trainer: max {difference.max():.2e}"
        assert np.abs(sampled - other_view).max() > 0.5, f"{name}: the two runs should sample differently"


def check_image_limit(service, base_model: str, limit: int) -> None:
    """`limit` images sample; one more is a 400 naming the limit, and the client goes on."""
    tc = service.create_lora_training_client(base_model=base_model, rank=4).result()
    prompts = ImagePrompts(tc)
    sampler = service.create_sampling_client(base_model=base_model).result()
    params = types.SamplingParams(max_tokens=2)
    images = [noise(32, 32, seed=seed) for seed in range(limit + 1)]
    fits = types.ModelInput(chunks=prompts.user_turn(images[:limit], "How many?"))
    assert len(sampler.sample(fits, num_samples=1, sampling_params=params).result().sequences[0].tokens) == 2
    too_many = types.ModelInput(chunks=prompts.user_turn(images, "How many?"))
    with pytest.raises(tinker.BadRequestError, match=f"{limit + 1} images; at most {limit} images per prompt"):
        sampler.sample(too_many, num_samples=1, sampling_params=params).result()
    assert sampler.sample(fits, num_samples=1, sampling_params=params).result().sequences
