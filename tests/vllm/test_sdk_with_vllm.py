"""`python -m server --sampler vllm`: the real SDK samples through a vLLM the server starts and supervises.

Parity is the sampler/trainer consistency RL relies on: sampled-token logprobs (vLLM) and prompt
logprobs (vLLM without LoRA; with LoRA the embedded engine beside it) equal the trainer's `forward`
logprobs (fp32: mean abs difference under 1e-4, max under 1e-3), for text and image prompts, before
and after training, with adapters loaded by path, lm_head included (Tinker's default
train_unembed=True, through the server's vLLM plugin). The module's server is the tiny Qwen3-VL
(Qwen2-VL is the direct tier's); the other families get a server each in the last test.
"""

import numpy as np
import pytest
import tinker
from server.config import DEFAULT_VLLM_PYTHON as VLLM_PYTHON
from tinker import types

from support.engine_checks import (check_concurrent_runs_sample_with_their_own_adapters, check_image_limit,
                                   check_inflight_clients_follow_the_newest_inflight_save,
                                   check_logprob_options_come_from_the_trainers_distribution)
from support.live_server import start_server
from support.sdk import check_sampling_parameters, forward_logprobs
from support.vision_sdk import ImagePrompts, noise

ADAM = types.AdamParams(learning_rate=3e-3)
VLLM_FLAGS = ("--sampler", "vllm", "--vllm-python", str(VLLM_PYTHON), "--vllm-max-lora-rank", "8")
FAMILY = "qwen3-vl"
BASE_MODEL = f"builtin:tiny-{FAMILY}"


def start_vllm_server(models_dir, tmp_path_factory, family: str, *flags: str):
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON.parent.parent}: run `bash scripts/install_vllm.sh`", pytrace=False)
    data_dir = tmp_path_factory.mktemp(f"sdk-vllm-{family}")
    return start_server(data_dir, f"sqlite:///{data_dir}/server.db", models_dir, *VLLM_FLAGS, *flags,
                        base_model=f"builtin:tiny-{family}", startup_seconds=600)


@pytest.fixture(scope="module")
def vllm_server(models_dir, tmp_path_factory):
    # Two adapters in a batch and two loaded: the eviction test below relies on it.
    server = start_vllm_server(models_dir, tmp_path_factory, FAMILY, "--vllm-max-loras", "2",
                               "--vllm-max-cpu-loras", "2")
    yield server
    server.stop()


def lora_client(server, seed: int):
    """A service client, a LoRA training client with Tinker's defaults (lm_head too) and its prompts."""
    service = server.service_client()
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=seed).result()
    return service, tc, ImagePrompts(tc)


FP32_PARITY = (1e-4, 1e-3)
"""Largest mean and largest single gap between vLLM's logprobs and the trainer's, in float32."""


def assert_parity(computed, expected, where: str, tolerance: tuple[float, float] = FP32_PARITY) -> None:
    difference = np.abs(np.asarray(computed, dtype=np.float64) - np.asarray(expected, dtype=np.float64))
    assert difference.mean() < tolerance[0] and difference.max() < tolerance[1], \
        f"{where}: mean {difference.mean():.2e}, max {difference.max():.2e}"


def prompts_for(prompts: ImagePrompts) -> list[types.Datum]:
    return [prompts.datum(prompts.user_turn([noise(90, 60, seed=1)], "Describe it."), "noise"),
            prompts.datum(prompts.user_turn([noise(64, 64, seed=2), noise(120, 200, seed=3)], "Compare."), "two"),
            prompts.datum(prompts.user_turn([], "No picture here."), "fine")]


def check_sampler_against_trainer(sampler, tc, prompts: ImagePrompts, data: list[types.Datum], where: str,
                                  tolerance: tuple[float, float] = FP32_PARITY) -> None:
    """Prompt logprobs (text positions) and sampled-token logprobs of `sampler` equal tc's forward."""
    for datum, expected in zip(data, forward_logprobs(tc, data)):
        computed = sampler.compute_logprobs(prompts.full_sequence(datum)).result()
        text = prompts.text_targets(datum)
        assert_parity(np.array(computed[1:], dtype=np.float64)[text], expected[text], f"{where} prompt logprobs",
                      tolerance)
    prompt_chunks = data[1].model_input.chunks[:-1]
    prompt_length = types.ModelInput(chunks=prompt_chunks).length
    sample = sampler.sample(types.ModelInput(chunks=prompt_chunks), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=6, seed=11, stop=[])).result()
    for sequence in sample.sequences:
        continued = types.ModelInput(chunks=prompt_chunks + [types.EncodedTextChunk(tokens=sequence.tokens[:-1])])
        targets = [0] * (prompt_length - 1) + sequence.tokens
        datum = types.Datum(model_input=continued, loss_fn_inputs={"target_tokens": targets,
                                                                   "weights": [1.0] * len(targets)})
        assert_parity(sequence.logprobs, forward_logprobs(tc, [datum])[0][prompt_length - 1:],
                      f"{where} sampled-token logprobs", tolerance)


def test_adapters_loaded_by_path_agree_with_the_trainer_before_and_after_training(vllm_server):
    service, tc, prompts = lora_client(vllm_server, seed=3)
    data = prompts_for(prompts)
    base = service.create_sampling_client(base_model=BASE_MODEL).result()
    check_sampler_against_trainer(base, tc, prompts, data, "base model")  # a fresh adapter is the base model
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    check_sampler_against_trainer(snapshot, tc, prompts, data, "snapshot after training")
    named = service.create_sampling_client(model_path=tc.save_weights_for_sampler("trained").result().path).result()
    check_sampler_against_trainer(named, tc, prompts, data, "saved checkpoint")
    log = (vllm_server.data_dir / "vllm.log").read_text()
    # vLLM itself loaded both (with lm_head: Tinker's default), and sampled with them.
    assert "checkpoint-" in log and ":sample:" in log


@pytest.mark.parametrize("train_unembed", [True, False], ids=["with-lm-head", "without-lm-head"])
def test_runs_sampling_at_once_each_sample_with_their_own_adapter(vllm_server, train_unembed):
    check_concurrent_runs_sample_with_their_own_adapters(vllm_server.service_client(), BASE_MODEL,
                                                         train_unembed=train_unembed)


def test_logprob_options_come_from_the_trainers_distribution(vllm_server):
    # Sampled top-k from vLLM (with the run's adapter); target ids and draws from the embedded engine beside it.
    check_logprob_options_come_from_the_trainers_distribution(vllm_server.service_client(), BASE_MODEL)


def test_inflight_clients_sample_each_inflight_save_through_vllm(vllm_server):
    check_inflight_clients_follow_the_newest_inflight_save(vllm_server.service_client(), BASE_MODEL)


def test_a_prompt_over_the_image_limit_is_refused_with_the_limit(vllm_server):
    # The server's limit is vLLM's too: a prompt at the limit goes through vLLM.
    check_image_limit(vllm_server.service_client(), BASE_MODEL, limit=16)


def test_an_adapter_evicted_by_vllm_is_reloaded_and_an_overwritten_one_is_never_stale(vllm_server):
    service, tc, prompts = lora_client(vllm_server, seed=6)
    data = prompts_for(prompts)
    prompt = types.ModelInput(chunks=data[0].model_input.chunks[:-1])
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    first = service.create_sampling_client(model_path=tc.save_weights_for_sampler("a").result().path).result()
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    second = service.create_sampling_client(model_path=tc.save_weights_for_sampler("b").result().path).result()
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    third = service.create_sampling_client(model_path=tc.save_weights_for_sampler("c").result().path).result()
    a_before = first.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    for later in (second, third):  # vLLM keeps two adapters loaded: a goes
        later.sample(prompt, num_samples=1, sampling_params=greedy).result()
    a_again = first.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    assert a_again.tokens == a_before.tokens
    np.testing.assert_allclose(a_again.logprobs, a_before.logprobs, atol=1e-6)
    # Overwriting "a" with the current weights: a new client sees them, not vLLM's copy of the old ones.
    overwritten = service.create_sampling_client(model_path=tc.save_weights_for_sampler("a").result().path).result()
    check_sampler_against_trainer(overwritten, tc, prompts, data, "overwritten checkpoint")


def test_every_kind_of_image_prompt_through_vllm_and_bad_images_refused(vllm_server):
    service, tc, prompts = lora_client(vllm_server, seed=7)
    repeated = noise(80, 80, seed=5)
    two_turns = (prompts.user_turn([noise(64, 64, seed=10)], "What is this?")
                 + [types.EncodedTextChunk(tokens=prompts.ids("Noise.<|im_end|>\n"))]
                 + prompts.user_turn([noise(96, 64, seed=11)], "And this one?"))
    data = [prompts.datum(prompts.user_turn([image], "What is it?"), "a picture")
            for image in (noise(70, 50, seed=4).convert("L"), noise(60, 60, seed=6).convert("RGBA"),
                          noise(50, 90, seed=7).convert("P"))]
    data += [prompts.datum(prompts.user_turn([repeated, repeated], "Same twice?"), "yes"),
             prompts.datum(two_turns, "More noise.")]
    base = service.create_sampling_client(base_model=BASE_MODEL).result()
    check_sampler_against_trainer(base, tc, prompts, data, "kinds of image")

    start, end = prompts.ids("<|vision_start|>"), prompts.ids("<|vision_end|>")
    corrupt = types.ImageChunk(data=b"\x89PNG\r\n\x1a\nnot really a png", format="png", expected_tokens=4)
    wrong_count = prompts.image_chunk(noise(64, 64, seed=12), expected_tokens=9)  # 64 tokens on Qwen3-VL
    for chunk, message in [(corrupt, "could not be decoded"), (wrong_count, "Expected 9 tokens, got 64 from image")]:
        prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=start), chunk,
                                          types.EncodedTextChunk(tokens=end)])
        with pytest.raises(tinker.BadRequestError, match=message):
            base.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=1)).result()
    assert base.sample(data[0].model_input, num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=2)).result().sequences


def test_sampling_parameters_through_vllm(vllm_server):
    service = vllm_server.service_client()
    # A base-model sampling client would look its tokenizer up on the hub; a training client's names
    # the model directory.
    tokenizer = service.create_lora_training_client(base_model=BASE_MODEL, rank=8).result().get_tokenizer()
    check_sampling_parameters(service.create_sampling_client(base_model=BASE_MODEL).result(), tokenizer)


@pytest.mark.parametrize("family,flags,tolerance", [
    ("qwen2.5-vl", (), FP32_PARITY),
    # vLLM's MoE LoRA kernels need a GPU: on CPU the server starts it without LoRA (no flag asked for it), it
    # serves the base model and the embedded engine serves adapters. Eager: vLLM caches no compile of the MoE
    # model, 60-70 s at every start.
    ("qwen3-vl-moe", ("--vllm-args=--enforce-eager",), FP32_PARITY)])
def test_every_vlm_family_samples_through_vllm_like_its_trainer(models_dir, tmp_path_factory, family, flags,
                                                                  tolerance):
    server = start_vllm_server(models_dir, tmp_path_factory, family, *flags)
    try:
        service = server.service_client()
        tc = service.create_lora_training_client(base_model=f"builtin:tiny-{family}", rank=8, seed=5).result()
        prompts = ImagePrompts(tc)
        data = prompts_for(prompts)
        base = service.create_sampling_client(base_model=f"builtin:tiny-{family}").result()
        check_sampler_against_trainer(base, tc, prompts, data, f"{family} base model", tolerance)
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(ADAM).result()
        check_sampler_against_trainer(tc.save_weights_and_get_sampling_client().result(), tc, prompts, data,
                                      f"{family} trained adapter", tolerance)
    finally:
        server.stop()
