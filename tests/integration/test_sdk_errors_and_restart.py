"""Bad input gets a clear 4xx and loses nothing; a restart keeps sessions, runs and checkpoints;
closed or silent sessions take their runs out of memory."""

import re
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from support.live_server import BASE_MODEL, start_server
from support.sdk import SENTENCES, forward_logprobs, prompt_of, supervised_datum

SILENCE_SECONDS = 4
"""--session-timeout of the expiry test: heartbeats 0.1 s apart keep a session alive well within it."""


@pytest.fixture(scope="module")
def client_and_data(service_client):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=21).result()
    tokenizer = tc.get_tokenizer()
    return tc, [supervised_datum(tokenizer, s) for s in SENTENCES[:2]]


def test_bad_training_input_is_a_400_and_the_run_goes_on(client_and_data):
    tc, data = client_and_data
    before = forward_logprobs(tc, data)
    ids = data[0].model_input.to_ints()
    wrong_length = types.Datum(model_input=data[0].model_input,
                               loss_fn_inputs={"target_tokens": ids[:-1], "weights": [1.0] * (len(ids) - 1)})
    with pytest.raises(tinker.BadRequestError, match="target_tokens has shape"):
        tc.forward_backward([wrong_length], "cross_entropy").result()
    out_of_vocab = types.Datum(model_input=types.ModelInput.from_ints([5, 10_000_000]),
                               loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]})
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        tc.forward_backward([out_of_vocab], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="loss_fn_config key"):
        tc.forward_backward(data, "ppo", loss_fn_config={"nonsense": 1.0}).result()
    policy_without_advantages = types.Datum(model_input=data[0].model_input,
                                            loss_fn_inputs={"target_tokens": data[0].loss_fn_inputs["target_tokens"]})
    with pytest.raises(tinker.BadRequestError, match="needs logprobs"):
        tc.forward_backward([policy_without_advantages], "importance_sampling").result()
    # Nothing was applied, and the run's later requests are not stuck behind the refused ones.
    for a, b in zip(before, forward_logprobs(tc, data)):
        np.testing.assert_array_equal(a, b)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert max(np.abs(a - b).max() for a, b in zip(before, forward_logprobs(tc, data))) > 1e-4


def test_bad_sampling_input_is_a_400(service_client, client_and_data):
    tc, data = client_and_data
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result()
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        sampler.sample(types.ModelInput.from_ints([1, 99_999_999]), num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.BadRequestError, match="max_tokens"):
        sampler.sample(types.ModelInput.from_ints([1, 2]), num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=10_000_000)).result()
    with pytest.raises(tinker.BadRequestError, match="not served here"):
        service_client.create_lora_training_client(base_model="Qwen/Qwen3-235B", rank=4).result()
    assert sampler.sample(types.ModelInput.from_ints(prompt_of(data[0])), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=2)).result().sequences


def test_malformed_requests_get_a_body_that_says_what_is_wrong(server, client_and_data):
    tc, data = client_and_data
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=30) as http:
        garbage = http.post("/api/v1/forward_backward", content=b"\xff\x00 not protobuf",
                            headers={"Content-Type": "application/x-protobuf"})
        assert garbage.status_code == 400 and "forward_backward body is not a valid" in garbage.json()["detail"]
        bomb = http.post("/api/v1/forward_backward", content=b"\x28\xb5\x2f\xfd garbage",
                         headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
        assert bomb.status_code == 400
        bad_json = http.post("/api/v1/optim_step", content=b"{not json", headers={"Content-Type": "application/json"})
        assert bad_json.status_code == 400 and bad_json.json()["detail"]
        unknown_model = http.post("/api/v1/optim_step", json={"model_id": "nope:train:0", "seq_id": 1,
                                                              "adam_params": {}})
        assert unknown_model.status_code == 404 and "nope:train:0" in unknown_model.json()["detail"]
        bad_image = http.post("/api/v1/asample", json={
            "sampling_session_id": "x", "seq_id": 0, "sampling_params": {},
            "prompt": {"chunks": [{"type": "image", "format": "png", "data": "%%%not-base64"}]}})
        assert bad_image.status_code == 400 and "base64" in bad_image.json()["detail"]
        assert http.post("/api/v1/retrieve_future", json={"request_id": "missing"}).status_code == 404
        assert httpx.post(f"{server.url}/api/v1/get_info", json={"model_id": tc.model_id}).status_code == 401
        # Still serving.
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}


def test_a_restart_keeps_sessions_runs_and_checkpoints(models_dir, tmp_path):
    data_dir, database_url = tmp_path / "data", f"sqlite:///{tmp_path}/journal.db"
    first = start_server(data_dir, database_url, models_dir)
    try:
        service = first.service_client()
        tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=31).result()
        data = [supervised_datum(tc.get_tokenizer(), s) for s in SENTENCES[:2]]
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = tc.save_state("before-restart").result().path
        sampler_path = tc.save_weights_for_sampler("before-restart").result().path
        expected = forward_logprobs(tc, data)
    finally:
        first.stop()

    second = start_server(data_dir, database_url, models_dir)
    try:
        service = second.service_client()
        rest = service.create_rest_client()
        listed = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
        assert sorted(listed) == sorted([state, sampler_path])
        assert tc.model_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
        resumed = service.create_training_client_from_state_with_optimizer(state).result()
        for a, b in zip(expected, forward_logprobs(resumed, data)):
            np.testing.assert_allclose(a, b, atol=1e-6)
        sampler = service.create_sampling_client(model_path=sampler_path).result()
        computed = sampler.compute_logprobs(types.ModelInput.from_ints(prompt_of(data[0]))).result()
        np.testing.assert_allclose(computed[1:], expected[0], atol=1e-4)
    finally:
        second.stop()


def test_closing_a_session_unloads_its_runs_but_keeps_their_checkpoints(server):
    service = server.service_client()
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=41).result()
    data = [supervised_datum(tc.get_tokenizer(), SENTENCES[0])]
    path = tc.save_state("kept").result().path
    # What ServiceClient.close() sends; sent by hand so this client can still try its run afterwards.
    session_id = tc.model_id.split(":train:")[0]
    finished = httpx.post(f"{server.url}/api/v1/sessions/{session_id}/finish", headers=server.headers(),
                          json={"reason": {"type": "success"}})
    assert finished.status_code == 200
    with pytest.raises(tinker.RequestFailedError, match="not loaded"):
        tc.forward(data, "cross_entropy").result()
    reopened = server.service_client().create_training_client_from_state(path).result()
    assert forward_logprobs(reopened, data)[0].shape == (data[0].model_input.length,)


def test_a_session_that_stops_heartbeating_is_finished_and_its_runs_leave_memory(models_dir, tmp_path):
    # Clients that exit without closing their ServiceClient (the cookbook's DPO recipe does) would
    # otherwise keep their adapters and optimizer state in memory for good.
    live = start_server(tmp_path / "data", f"sqlite:///{tmp_path}/journal.db", models_dir, "--session-timeout",
                        str(SILENCE_SECONDS))
    try:
        with httpx.Client(base_url=live.url, headers=live.headers(), timeout=30) as http:
            def create_session_and_run() -> tuple[str, str]:
                session_id = http.post("/api/v1/create_session", json={}).json()["session_id"]
                created = http.post("/api/v1/create_model", json={
                    "session_id": session_id, "model_seq_id": 0, "base_model": BASE_MODEL, "lora_config": {"rank": 4}})
                result = http.post("/api/v1/retrieve_future", json={"request_id": created.json()["request_id"]})
                return session_id, result.json()["model_id"]

            def optim_step(model_id: str) -> dict:
                future = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1,
                                                               "adam_params": {"learning_rate": 1e-3}})
                return http.post("/api/v1/retrieve_future", json={"request_id": future.json()["request_id"]}).json()

            (silent, silent_model), (beating, beating_model) = create_session_and_run(), create_session_and_run()
            # Only one session heartbeats, back to back, until the server logs that it finished the other
            # (it looks every quarter timeout); the deadline is a hang guard, not a margin.
            deadline = time.monotonic() + 120
            while not re.search(rf"finished \d+ sessions silent for over .*{silent}", live.log_path.read_text()):
                assert time.monotonic() < deadline, live.log()
                assert http.post("/api/v1/session_heartbeat", json={"session_id": beating}).status_code == 200
                time.sleep(0.1)
            assert http.post("/api/v1/session_heartbeat", json={"session_id": silent}).status_code == 410
            assert "not loaded" in optim_step(silent_model)["error"]
            assert "error" not in optim_step(beating_model)
    finally:
        live.stop()
