"""What every sampling engine must do through the real SDK; shared by the embedded engine's SDK tests and vLLM's.

- Isolation: two runs on one server (one trained far from the base, one fresh) sample at once, many
  concurrent requests each, text and image prompts, several samples per request; every sampled
  token's logprob equals its own run's trainer `forward` (fp32, max |diff| under 1e-3), and differs
  from what the other run's weights give.
- The image limit: a prompt with one image too many is a 400 that names the limit.
- The logprob options (topk_sample_logprobs, target_prompt_logprobs dense and sparse, prompt_alt_tokens_k)
  report the trainer's distribution over the whole vocabulary, media placeholders masked.
- Inflight sampling clients sample with their run's newest inflight save; snapshots keep theirs.
"""

import asyncio

import numpy as np
import pytest
import tinker
from tinker import types
from tinker_cookbook.recipes.decisions.decision import DecisionRendering, sample_decision
from transformers import AutoConfig

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


def vocabulary_of(training_client: tinker.TrainingClient, prompts: ImagePrompts) -> tuple[int, list[int]]:
    """The model's vocabulary size (its output rows, padding ids included) and the media placeholder ids."""
    directory = training_client.get_info().model_data.tokenizer_id
    vocab_size = AutoConfig.from_pretrained(directory).get_text_config().vocab_size
    return vocab_size, [prompts.ids(token)[0] for token in ("<|image_pad|>", "<|video_pad|>")]


def trainer_distribution(training_client: tinker.TrainingClient, chunks: list, vocab_size: int,
                         refused: list[int]) -> np.ndarray:
    """The trainer's logprobs of every token id after each prefix of `chunks` (row t: the distribution of
    token t + 1), the media placeholders at -inf (the trainer reports 0 for a placeholder target: given,
    never predicted)."""
    length = types.ModelInput(chunks=chunks).length
    every_id = np.tile(np.arange(vocab_size, dtype=np.int64), (length, 1))
    datum = types.Datum(model_input=types.ModelInput(chunks=chunks),
                        loss_fn_inputs={"target_tokens": every_id,
                                        "weights": np.zeros((length, vocab_size), dtype=np.float32)})
    output = training_client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    distribution = output.to_numpy().reshape(length, vocab_size).astype(np.float64)
    distribution[:, refused] = -np.inf
    return distribution


def assert_close(computed, expected, where: str, atol: float = 1e-3) -> None:
    difference = np.abs(np.asarray(computed, dtype=np.float64) - np.asarray(expected, dtype=np.float64))
    assert difference.max() < atol, f"{where}: max |sampler - trainer| {difference.max():.2e}"


def check_logprob_options_come_from_the_trainers_distribution(service, base_model: str) -> None:
    tc = service.create_lora_training_client(base_model=base_model, rank=8, seed=4).result()
    prompts = ImagePrompts(tc)
    chunks = prompts.user_turn([noise(64, 64, seed=8)], "What is in the picture?")
    for _ in range(2):  # far from the base, so that a sampler that ignored the adapter would show
        tc.forward_backward([prompts.datum(chunks, "Noise.")], "cross_entropy").result()
        tc.optim_step(FAR).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    vocab_size, refused = vocabulary_of(tc, prompts)
    prompt = types.ModelInput(chunks=chunks)
    length = prompt.length
    distribution = trainer_distribution(tc, chunks, vocab_size, refused)[:length - 1]

    # The k best at each sampled position: the trainer's k best values (ties may swap ids), and each
    # reported id's own trainer logprob.
    sample = sampler.sample(prompt, num_samples=2, topk_sample_logprobs=4,
                            sampling_params=types.SamplingParams(max_tokens=5, seed=3, stop=[])).result()
    for sequence in sample.sequences:
        seen = trainer_distribution(tc, chunks + [types.EncodedTextChunk(tokens=sequence.tokens[:-1])],
                                    vocab_size, refused)[length - 1:]
        assert len(sequence.topk_logprobs) == len(sequence.tokens) == len(seen)
        for row, best in zip(seen, sequence.topk_logprobs):
            ids, values = np.array([t for t, _ in best]), np.array([v for _, v in best])
            assert_close(values, np.sort(row)[::-1][:4], "top-k sampled logprobs")
            assert_close(values, row[ids], "top-k sampled ids")

    # Dense target ids at every prompt position, -1 and placeholders among them; greedy draws.
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab_size, (length - 1, 3))
    ids[rng.random(ids.shape) < 0.3] = -1
    ids[::4, 2] = refused[0]
    scored = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=1, temperature=0),
                            target_prompt_logprobs=types.TensorData.from_numpy(ids), prompt_alt_tokens_k=2).result()
    rows = np.arange(length - 1)[:, None]
    expected = np.where((ids < 0) | np.isin(ids, refused), 0.0, distribution[rows, np.maximum(ids, 0)])
    assert scored.target_prompt_logprobs.shape == [length - 1, 3]
    assert_close(scored.target_prompt_logprobs.to_numpy(), expected, "dense target_prompt_logprobs")
    greedy = scored.prompt_alt_tokens.tokens.to_numpy()
    assert greedy.shape == (length - 1, 2) and (greedy[:, :1] == greedy).all()
    assert_close(distribution[rows, greedy], distribution.max(axis=1, keepdims=True).repeat(2, 1), "greedy draws")
    assert_close(scored.prompt_alt_tokens.logprobs.to_numpy(), distribution[rows, greedy], "greedy draw logprobs")

    # Draws at temperature 1: never a placeholder, the trainer's logprobs, the same again for the same seed.
    params = types.SamplingParams(max_tokens=1, temperature=1.0, seed=7)
    drawn = [sampler.sample(prompt, num_samples=1, sampling_params=params, prompt_alt_tokens_k=8).result()
             .prompt_alt_tokens for _ in range(2)]
    tokens = drawn[0].tokens.to_numpy()
    assert (tokens == drawn[1].tokens.to_numpy()).all() and not np.isin(tokens, refused).any()
    assert_close(drawn[0].logprobs.to_numpy(), distribution[rows, tokens], "drawn alternatives")

    # Sparse target ids, one row, as the cookbook's decisions recipe sends them: its probabilities
    # are the softmax of the trainer's logprobs of the labels.
    text = prompts.ids("<|im_start|>user\nRed, green or blue?<|im_end|>\n<|im_start|>assistant\nchoice#")
    labels = {"red": prompts.ids("A")[0], "green": prompts.ids("B")[0], "blue": prompts.ids("C")[0]}
    rendering = DecisionRendering(tokens=text + [0], choice_pos=len(text), label_tokens=labels)
    probabilities = asyncio.run(sample_decision(sampler, rendering))
    scores = trainer_distribution(tc, [types.EncodedTextChunk(tokens=text)], vocab_size, refused)[-1, list(labels.values())]
    assert_close(list(probabilities.values()), np.exp(scores) / np.exp(scores).sum(), "decision probabilities")


def check_inflight_clients_follow_the_newest_inflight_save(service, base_model: str) -> None:
    tc = service.create_lora_training_client(base_model=base_model, rank=8, seed=9).result()
    prompts = ImagePrompts(tc)
    chunks = prompts.user_turn([noise(64, 64, seed=11)], "What is in the picture?")
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])

    def sampled_and_trainer(sampler) -> tuple[np.ndarray, np.ndarray]:
        """A greedy continuation's logprobs from `sampler`, and the trainer's of the same tokens now."""
        sequence = sampler.sample(types.ModelInput(chunks=chunks), num_samples=1,
                                  sampling_params=greedy).result().sequences[0]
        trainer = forward_logprobs(tc, [continuation(chunks, sequence.tokens)])[0][-len(sequence.tokens):]
        return np.asarray(sequence.logprobs), trainer

    first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    at_first_save, trainer = sampled_and_trainer(first)
    assert_close(at_first_save, trainer, "inflight client at its save")
    tc.forward_backward([prompts.datum(chunks, "Noise.")], "cross_entropy").result()
    tc.optim_step(FAR).result()
    # Training alone moves no sampler: inflight clients follow inflight saves.
    sampled, trainer = sampled_and_trainer(first)
    assert_close(sampled, at_first_save, "inflight client before the next inflight save", atol=1e-6)
    assert np.abs(sampled - trainer).max() > 0.1, "the step should have changed the trainer's logprobs"
    second = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    for client, name in ((first, "first inflight client"), (second, "second inflight client")):
        assert_close(*sampled_and_trainer(client), f"{name} after the second inflight save")
    assert_close(sampled_and_trainer(snapshot)[0], at_first_save, "snapshot client", atol=1e-6)
