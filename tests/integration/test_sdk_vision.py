"""Vision-language prompts through the real SDK: image chunks in training and sampling on the built-in
tiny VLMs, sampler/trainer agreement for every family, learning colours, and bad images refused."""

import threading

import numpy as np
import pytest
import tinker
from PIL import Image
from tinker import types

from support.live_server import start_server
from support.sdk import forward_logprobs
from support.vision_sdk import COLOURS, QUESTION, ImagePrompts, noise, square

# Qwen3.5's dense member is checked against transformers in tests/unit/sampling (batched, with adapters).
FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "qwen3.5-moe"]
ADAM = types.AdamParams(learning_rate=3e-3)


@pytest.fixture(scope="module")
def vision_servers(models_dir, tmp_path_factory):
    """One live server per tiny VLM family, started on first use (SQLite journal)."""
    servers = {}

    def get(family: str):
        if family not in servers:
            data_dir = tmp_path_factory.mktemp(f"vision-{family}")
            servers[family] = start_server(data_dir, f"sqlite:///{data_dir}/server.db", models_dir,
                                           base_model=f"builtin:tiny-{family}")
        return servers[family]

    yield get
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="module")
def qwen2_vl(vision_servers):
    """A service client, a training client and prompt builders on tiny Qwen2-VL."""
    service = vision_servers("qwen2-vl").service_client()
    tc = service.create_lora_training_client(base_model="builtin:tiny-qwen2-vl", rank=8, seed=0).result()
    return service, tc, ImagePrompts(tc)


def _colour_data(prompts: ImagePrompts, per_colour: int, seed: int):
    rng = np.random.default_rng(seed)
    examples = [(square(colour, int(rng.integers(40, 100)), rng), colour) for _ in range(per_colour)
                for colour in COLOURS]
    return [(prompts.user_turn([image], QUESTION), colour) for image, colour in examples]


def test_several_text_chunks_give_the_same_logprobs_and_update_as_one_chunk_and_as_a_text_request(qwen2_vl):
    service, _, prompts = qwen2_vl
    ids = prompts.ids("<|im_start|>user\nWhat colour is the sky? It is blue.<|im_end|>")
    targets = {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}
    one_chunk = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=targets)
    pieces = [ids[:3], ids[3:4], ids[4:9], ids[9:-1]]
    many_chunks = types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=p) for p in pieces]),
                              loss_fn_inputs=targets)
    results = []
    for datum in (one_chunk, many_chunks):
        tc = service.create_lora_training_client(base_model="builtin:tiny-qwen2-vl", rank=4, seed=7).result()
        before = forward_logprobs(tc, [datum])[0]
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(ADAM).result()
        results.append((before, forward_logprobs(tc, [datum])[0]))
    (one_before, one_after), (many_before, many_after) = results
    np.testing.assert_allclose(one_before, many_before, atol=1e-6)
    np.testing.assert_allclose(one_after, many_after, atol=1e-6)
    assert np.abs(one_after - one_before).max() > 1e-3
    # The same text through a sampler (text-only request) scores the same as the trainer.
    sampler = service.create_sampling_client(base_model="builtin:tiny-qwen2-vl").result()
    computed = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    np.testing.assert_allclose(computed[1:], one_before, atol=1e-4)


def test_red_square_is_learned_and_answered_by_greedy_sampling(qwen2_vl, record_property):
    service, _, prompts = qwen2_vl
    tc = service.create_lora_training_client(base_model="builtin:tiny-qwen2-vl", rank=16, seed=0).result()
    train = [prompts.datum(chunks, colour) for chunks, colour in _colour_data(prompts, 6, seed=0)]
    held_out = _colour_data(prompts, 3, seed=1)  # new squares: other sizes and shades

    def ranking_accuracy(sampler) -> float:
        """Fraction of held-out squares whose true colour has the highest logprob among the three answers."""
        correct = 0
        for chunks, colour in held_out:
            scores = {}
            for answer in COLOURS:
                datum = prompts.datum(chunks, answer)
                logprobs = sampler.compute_logprobs(prompts.full_sequence(datum)).result()
                weights = datum.loss_fn_inputs["weights"].tolist()
                scores[answer] = sum(lp * w for lp, w in zip(logprobs[1:], weights))
            correct += max(scores, key=scores.get) == colour
        return correct / len(held_out)

    def greedy_accuracy(sampler) -> float:
        correct = 0
        for chunks, colour in held_out:
            out = sampler.sample(types.ModelInput(chunks=chunks), num_samples=1,
                                 sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result()
            correct += prompts.tokenizer.decode(out.sequences[0].tokens).startswith(colour)
        return correct / len(held_out)

    before = tc.save_weights_and_get_sampling_client().result()
    ranking_before = ranking_accuracy(before)
    record_property("colour_ranking_accuracy_before_training", ranking_before)
    losses = []
    for _ in range(25):
        losses.append(tc.forward_backward(train, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(ADAM).result()
    after = tc.save_weights_and_get_sampling_client().result()
    record_property("colour_ranking_accuracy_after_training", ranking_accuracy(after))
    assert losses[-1] < 0.1 * losses[0]
    assert ranking_accuracy(after) == 1.0
    assert greedy_accuracy(after) == 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_sampler_logprobs_equal_the_trainers_forward_on_image_prompts(vision_servers, family):
    service = vision_servers(family).service_client()
    tc = service.create_lora_training_client(base_model=f"builtin:tiny-{family}", rank=8, seed=3).result()
    prompts = ImagePrompts(tc)
    data = [prompts.datum(prompts.user_turn([noise(90, 60, seed=1)], "Describe it."), "noise"),
            prompts.datum(prompts.user_turn([noise(64, 64, seed=2), noise(120, 200, seed=3)], "Compare them."),
                          "two"),
            prompts.datum(prompts.user_turn([], "No picture here."), "fine")]
    for _ in range(2):  # a trained adapter, not the zero-initialised one
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()
    trainer_logprobs = forward_logprobs(tc, data)
    sampler = tc.save_weights_and_get_sampling_client().result()
    for datum, expected in zip(data, trainer_logprobs):
        computed = sampler.compute_logprobs(prompts.full_sequence(datum)).result()
        assert computed[0] is None and len(computed) == len(expected) + 1
        computed = np.array(computed[1:], dtype=np.float64)
        assert np.isfinite(expected).all() and np.isfinite(computed).all()
        # At image positions the client's target is 0 while the sampler scores the image pad itself.
        text = prompts.text_targets(datum)
        np.testing.assert_allclose(computed[text], expected[text], atol=1e-4)
    # Sampled tokens' logprobs equal the trainer's logprobs of the same continuation.
    prompt_chunks = data[1].model_input.chunks[:-1]
    sample = sampler.sample(types.ModelInput(chunks=prompt_chunks), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=5, seed=11, stop=[])).result()
    prompt_length = types.ModelInput(chunks=prompt_chunks).length
    for sequence in sample.sequences:
        continued = types.ModelInput(chunks=prompt_chunks + [types.EncodedTextChunk(tokens=sequence.tokens[:-1])])
        targets = [0] * (prompt_length - 1) + sequence.tokens
        datum = types.Datum(model_input=continued, loss_fn_inputs={"target_tokens": targets,
                                                                   "weights": [1.0] * len(targets)})
        np.testing.assert_allclose(sequence.logprobs, forward_logprobs(tc, [datum])[0][prompt_length - 1:],
                                   atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3-vl-moe", "qwen3.5-moe"])
def test_an_adapter_of_the_routed_experts_alone_samples_from_its_saved_path(vision_servers, family):
    # A sampler checkpoint keeps no train_* flags: the engine infers them from the modules' names, where the
    # routed experts are named by their module. An experts-only adapter once inferred none and every request
    # sampled from its path failed with a 500.
    service = vision_servers(family).service_client()
    tc = service.create_lora_training_client(base_model=f"builtin:tiny-{family}", rank=4, seed=5, train_attn=False,
                                             train_unembed=False).result()
    prompts = ImagePrompts(tc)
    data = [prompts.datum(prompts.user_turn([noise(64, 48, seed=10)], "What is it?"), "noise"),
            prompts.datum(prompts.user_turn([], "Say something."), "something")]
    base = forward_logprobs(tc, data)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trained = forward_logprobs(tc, data)
    assert max(np.abs(t - b).max() for t, b in zip(trained, base)) > 1e-3  # the experts' factors moved them
    path = tc.save_weights_for_sampler("experts-only").result().path
    sampler = service.create_sampling_client(model_path=path).result()
    for datum, expected in zip(data, trained):
        computed = np.array(sampler.compute_logprobs(prompts.full_sequence(datum)).result()[1:], dtype=np.float64)
        text = prompts.text_targets(datum)
        np.testing.assert_allclose(computed[text], expected[text], atol=1e-4)


def test_batches_with_images_are_permutation_invariant_and_cover_every_kind_of_image(qwen2_vl):
    service, tc, prompts = qwen2_vl
    repeated = noise(80, 80, seed=5)
    kinds = [noise(70, 50, seed=4).convert("L"), noise(60, 60, seed=6).convert("RGBA"),
             noise(50, 90, seed=7).convert("P"), repeated]
    data = [prompts.datum(prompts.user_turn([image], "What is it?"), "a picture") for image in kinds]
    data.append(prompts.datum(prompts.user_turn([repeated, repeated], "Same twice?"), "yes"))
    data.append(prompts.datum(prompts.user_turn([noise(40, 40, seed=8), noise(300, 120, seed=9)], "Two sizes."),
                              "ok"))
    data.append(prompts.datum(prompts.user_turn([], "Text only."), "ok"))
    forward = forward_logprobs(tc, data)
    order = [6, 2, 0, 5, 3, 1, 4]
    permuted = forward_logprobs(tc, [data[i] for i in order])
    for position, index in enumerate(order):
        np.testing.assert_allclose(permuted[position], forward[index], atol=1e-5)
    for datum, logprobs in zip(data, forward):
        assert len(logprobs) == datum.model_input.length and np.isfinite(logprobs).all()
    # The repeated image scores the same wherever it appears.
    single = forward_logprobs(tc, [data[3]])[0]
    np.testing.assert_allclose(single, forward[3], atol=1e-5)


def test_a_two_turn_conversation_with_an_image_in_each_user_turn(qwen2_vl):
    service, tc, prompts = qwen2_vl
    first_turn = prompts.user_turn([noise(64, 64, seed=10)], "What is this?")
    reply = [types.EncodedTextChunk(tokens=prompts.ids("Noise.<|im_end|>\n"))]
    second_turn = prompts.user_turn([noise(96, 64, seed=11)], "And this one?")
    conversation = first_turn + reply + second_turn
    datum = prompts.datum(conversation, "More noise.")
    result = tc.forward_backward([datum], "cross_entropy").result()
    assert np.isfinite(result.metrics["loss:sum"])
    tc.optim_step(ADAM).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    computed = np.array(sampler.compute_logprobs(prompts.full_sequence(datum)).result()[1:])
    text = prompts.text_targets(datum)
    np.testing.assert_allclose(computed[text], forward_logprobs(tc, [datum])[0][text], atol=1e-4)
    sample = sampler.sample(types.ModelInput(chunks=conversation), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=3)).result()
    assert len(sample.sequences[0].tokens) >= 1


def test_expected_tokens_mismatch_is_refused_on_both_paths(qwen2_vl):
    service, tc, prompts = qwen2_vl
    image = noise(64, 64, seed=12)  # 4 tokens on Qwen2-VL
    wrong = [types.EncodedTextChunk(tokens=prompts.ids("<|vision_start|>")),
             prompts.image_chunk(image, expected_tokens=9),
             types.EncodedTextChunk(tokens=prompts.ids("<|vision_end|>"))]
    datum = types.Datum(model_input=types.ModelInput(chunks=wrong),
                        loss_fn_inputs={"target_tokens": [0] * 11, "weights": [0.0] * 11})
    with pytest.raises(tinker.BadRequestError, match="Expected 9 tokens, got 4 from image"):
        tc.forward_backward([datum], "cross_entropy").result()
    sampler = service.create_sampling_client(base_model="builtin:tiny-qwen2-vl").result()
    with pytest.raises(tinker.BadRequestError, match="Expected 9 tokens, got 4 from image"):
        sampler.sample(types.ModelInput(chunks=wrong), num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=1)).result()


def test_oversized_and_corrupt_images_are_refused_while_other_clients_keep_training(qwen2_vl, vision_servers):
    service, tc, prompts = qwen2_vl
    live = vision_servers("qwen2-vl")
    other = live.service_client(api_key=live.create_key("other-tenant"))
    other_tc = other.create_lora_training_client(base_model="builtin:tiny-qwen2-vl", rank=4, seed=1).result()
    other_data = [prompts.datum(prompts.user_turn([noise(64, 64, seed=13)], "Go on."), "yes")]
    errors: list[Exception] = []
    stop = threading.Event()

    def keep_training():
        try:
            while not stop.is_set():
                other_tc.forward_backward(other_data, "cross_entropy").result()
                other_tc.optim_step(ADAM).result()
        except Exception as error:  # reported below: the other tenant must never notice
            errors.append(error)

    worker = threading.Thread(target=keep_training)
    worker.start()
    try:
        start, end = prompts.ids("<|vision_start|>"), prompts.ids("<|vision_end|>")
        corrupt = types.ImageChunk(data=b"\x89PNG\r\n\x1a\nthis is not really a png", format="png", expected_tokens=4)
        huge = prompts.image_chunk(Image.new("L", (8000, 8000)))  # 64 megapixels: over the server's limit
        for chunk, message in [(corrupt, "could not be decoded"), (huge, "over the limit of")]:
            chunks = [types.EncodedTextChunk(tokens=start), chunk, types.EncodedTextChunk(tokens=end)]
            length = types.ModelInput(chunks=chunks).length
            datum = types.Datum(model_input=types.ModelInput(chunks=chunks),
                                loss_fn_inputs={"target_tokens": [0] * length, "weights": [0.0] * length})
            with pytest.raises(tinker.BadRequestError, match=message):
                tc.forward_backward([datum], "cross_entropy").result()
            sampler = service.create_sampling_client(base_model="builtin:tiny-qwen2-vl").result()
            with pytest.raises(tinker.BadRequestError, match=message):
                sampler.sample(types.ModelInput(chunks=chunks), num_samples=1,
                               sampling_params=types.SamplingParams(max_tokens=1)).result()
        # This client goes on too.
        assert np.isfinite(tc.forward_backward(other_data, "cross_entropy").result().metrics["loss:sum"])
    finally:
        stop.set()
        worker.join(timeout=120)
    assert not errors
