"""Sampling and checkpoints through the real SDK: sampler/trainer logprob agreement, sampling
parameters, save/load/resume with the optimizer, PEFT-loadable sampler weights, REST listings."""

import numpy as np
import pytest
import tinker
from tinker import types

from server.models.builtin import served_name
from support.live_server import BASE_MODEL
from support.sdk import (SENTENCES, check_sampling_parameters, forward_logprobs, peft_logprobs, prompt_of,
                         supervised_datum)

ADAM = types.AdamParams(learning_rate=5e-3)


@pytest.fixture(scope="module")
def trained(service_client):
    """A run trained for a few steps, with its tokenizer and data."""
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=11).result()
    tokenizer = tc.get_tokenizer()
    data = [supervised_datum(tokenizer, s) for s in SENTENCES[:3]]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()
    return tc, tokenizer, data


def test_sampler_logprobs_agree_with_the_trainers_forward(service_client, trained):
    tc, tokenizer, data = trained
    trainer_logprobs = forward_logprobs(tc, data)
    named = tc.save_weights_for_sampler("agree").result().path
    for sampler in (tc.save_weights_and_get_sampling_client().result(),
                    service_client.create_sampling_client(model_path=named).result()):
        for datum, expected in zip(data, trainer_logprobs):
            prompt = types.ModelInput.from_ints(prompt_of(datum))
            computed = sampler.compute_logprobs(prompt).result()
            assert computed[0] is None
            np.testing.assert_allclose(np.array(computed[1:], dtype=np.float64), expected, atol=1e-4)
        # Sampled tokens' logprobs equal the trainer's logprobs of the same continuation.
        prompt_ids = prompt_of(data[0])[:4]
        sample = sampler.sample(types.ModelInput.from_ints(prompt_ids), num_samples=2,
                                sampling_params=types.SamplingParams(max_tokens=6, seed=5)).result()
        for sequence in sample.sequences:
            full = prompt_ids + sequence.tokens
            datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
            trainer_view = forward_logprobs(tc, [datum])[0][len(prompt_ids) - 1:]
            np.testing.assert_allclose(sequence.logprobs, trainer_view, atol=1e-4)


def test_sampling_parameters_are_honoured(service_client, trained):
    tc, tokenizer, data = trained
    check_sampling_parameters(service_client.create_sampling_client(base_model=BASE_MODEL).result(), tokenizer)


def test_prompt_logprobs_and_top_k_prompt_logprobs(service_client, trained):
    tc, tokenizer, data = trained
    sampler = tc.save_weights_and_get_sampling_client().result()
    ids = prompt_of(data[0])
    response = sampler.sample(types.ModelInput.from_ints(ids), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=1),
                              include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    assert response.prompt_logprobs[0] is None and len(response.prompt_logprobs) == len(ids)
    assert response.topk_prompt_logprobs[0] is None
    for position in range(1, len(ids)):
        top = response.topk_prompt_logprobs[position]
        assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0][1] >= response.prompt_logprobs[position] - 1e-6
        if ids[position] in [token for token, _ in top]:
            assert dict(top)[ids[position]] == pytest.approx(response.prompt_logprobs[position], abs=1e-5)
    last_n = sampler.compute_logprobs(types.ModelInput.from_ints(ids), prompt_logprobs_last_n=2).result()
    assert last_n[:-2] == [None] * (len(ids) - 2)
    np.testing.assert_allclose(last_n[-2:], response.prompt_logprobs[-2:], atol=1e-6)


def test_save_state_and_load_with_optimizer_reproduce_logprobs_and_the_next_update(service_client, trained):
    tc, tokenizer, data = trained
    path = tc.save_state("resume-me").result().path
    assert path == f"tinker://{tc.model_id}/weights/resume-me"
    expected_now = forward_logprobs(tc, data)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    expected_next = forward_logprobs(tc, data)

    resumed = service_client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().lora_rank == 8
    for a, b in zip(expected_now, forward_logprobs(resumed, data)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    reloaded = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=99).result()
    reloaded.load_state_with_optimizer(path).result()
    for client in (resumed, reloaded):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(ADAM).result()
        for a, b in zip(expected_next, forward_logprobs(client, data)):
            np.testing.assert_allclose(a, b, atol=1e-5)

    # Without the optimizer the weights come back but the Adam moments start afresh.
    weights_only = service_client.create_training_client_from_state(path).result()
    weights_only.forward_backward(data, "cross_entropy").result()
    weights_only.optim_step(ADAM).result()
    assert max(np.abs(a - b).max() for a, b in zip(expected_next, forward_logprobs(weights_only, data))) > 1e-4


def test_a_run_created_from_a_checkpoint_keeps_its_user_metadata(service_client, trained):
    # The cookbook reads renderer_name back from the run of a checkpoint; a resumed run must keep it.
    tc, tokenizer, data = trained
    path = tc.save_state("with-metadata").result().path
    rest = service_client.create_rest_client()
    for create in (service_client.create_training_client_from_state_with_optimizer,
                   service_client.create_training_client_from_state):
        resumed = create(path, user_metadata={"renderer_name": "qwen3"}).result()
        later = resumed.save_state("later").result().path
        assert rest.get_training_run_by_tinker_path(later).result().user_metadata == {"renderer_name": "qwen3"}
    with pytest.raises(tinker.BadRequestError, match="optimizer 'dimuon' is not supported"):
        service_client.create_training_client_from_state(path, optimizer=types.DimuonOptimizerConfig()).result()


def test_sampler_checkpoints_load_in_peft(server, service_client, trained):
    tc, tokenizer, data = trained
    path = tc.save_weights_for_sampler("for-peft").result().path
    run_id, _, name = path.removeprefix("tinker://").split("/")
    # Each save is a version directory of its own; the one listed is the only one left.
    (adapter_dir,) = (server.data_dir / "checkpoints" / run_id / "sampler_weights" / name).glob("v-*")
    base_dir = server.data_dir / "models" / BASE_MODEL.removeprefix("builtin:")
    np.testing.assert_allclose(peft_logprobs(base_dir, adapter_dir, prompt_of(data[0])),
                               forward_logprobs(tc, data[:1])[0], atol=1e-4)


def test_rest_listings_and_checkpoint_deletion(service_client, trained):
    tc, tokenizer, data = trained
    rest = service_client.create_rest_client()
    state = tc.save_state("listed").result().path
    sampler_path = tc.save_weights_for_sampler("listed").result().path
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[state].checkpoint_type == "training" and listed[sampler_path].checkpoint_type == "sampler"
    assert listed[state].size_bytes > listed[sampler_path].size_bytes > 0
    run = rest.get_training_run(tc.model_id).result()
    assert run.base_model == served_name(BASE_MODEL) and run.is_lora and run.lora_rank == 8
    runs = rest.list_training_runs().result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert info.base_model == served_name(BASE_MODEL) and info.lora_rank == 8
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    remaining = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert sampler_path not in remaining and state in remaining
    with pytest.raises(Exception, match="404|no checkpoint"):
        service_client.create_sampling_client(model_path=sampler_path).result()


def test_another_tenant_sees_nothing(server, trained):
    tc, tokenizer, data = trained
    stranger = server.service_client(api_key=server.create_key("someone-else")).create_rest_client()
    assert tc.model_id not in [r.training_run_id for r in stranger.list_training_runs().result().training_runs]
    with pytest.raises(Exception, match="404"):
        stranger.list_checkpoints(tc.model_id).result()
