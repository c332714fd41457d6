"""The SDK's logprob options and inflight sampling clients on the embedded engine, on a tiny Qwen2-VL (image
prompts, masked media placeholders), checked against the trainer's distribution over the whole vocabulary;
bad target ids are refused by name. The same checks run on vLLM in tests/vllm/test_sdk_with_vllm.py."""

import numpy as np
import pytest
import tinker
from tinker import types

from support.engine_checks import (check_inflight_clients_follow_the_newest_inflight_save,
                                   check_logprob_options_come_from_the_trainers_distribution)
from support.live_server import start_server

BASE_MODEL = "builtin:tiny-qwen2-vl"


@pytest.fixture(scope="module")
def vlm_server(models_dir, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("sampling-options")
    server = start_server(data_dir, f"sqlite:///{data_dir}/server.db", models_dir, base_model=BASE_MODEL)
    yield server
    server.stop()


def test_every_logprob_option_comes_from_the_trainers_distribution(vlm_server):
    check_logprob_options_come_from_the_trainers_distribution(vlm_server.service_client(), BASE_MODEL)


def test_inflight_sampling_clients_follow_their_runs_newest_inflight_save(vlm_server):
    check_inflight_clients_follow_the_newest_inflight_save(vlm_server.service_client(), BASE_MODEL)


def test_bad_target_prompt_logprobs_are_refused_by_name_and_the_client_goes_on(vlm_server):
    service = vlm_server.service_client()
    sampler = service.create_sampling_client(base_model=BASE_MODEL).result()
    prompt = types.ModelInput.from_ints([11, 12, 13, 14, 15])
    params = types.SamplingParams(max_tokens=1)

    def sample(ids):
        return sampler.sample(prompt, num_samples=1, sampling_params=params,
                              target_prompt_logprobs=types.TensorData.from_numpy(np.asarray(ids, dtype=np.int64)))

    for ids, message in [([[5]] * 3, "has 3 rows; a prompt of 5 tokens needs len\\(prompt\\) - 1 = 4"),
                         ([[5], [-1], [10**6], [-1]], "names token id 1000000"),
                         ([[-1]] * 4, "names no token id"),
                         (np.full((4, 1025), 5), "at most 1024")]:
        with pytest.raises(tinker.BadRequestError, match=message):
            sample(ids).result()
    logprobs = sample([[5], [-1], [6], [-1]]).result().target_prompt_logprobs.to_numpy()
    assert logprobs.shape == (4, 1) and logprobs[1, 0] == logprobs[3, 0] == 0.0 and logprobs[0, 0] < 0
