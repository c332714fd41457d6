"""One bad call never wedges a run: every refusal the SDK (or a raw client) can provoke is a 400, and the
same client's next call goes on, because a refused request still takes its seq_id."""

import io

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from PIL import Image
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from server.wire import tinker_public_pb2 as pb
from support.live_server import BASE_MODEL
from support.sdk import SENTENCES, supervised_datum

NEXT_CALL_SECONDS = 60  # a wedged run never answers; a working one answers in well under a second here


@pytest.fixture(scope="module")
def client_and_data(service_client):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=61).result()
    return tc, [supervised_datum(tc.get_tokenizer(), s) for s in SENTENCES[:2]]


def _datum(model_input: types.ModelInput, weights: list[float], targets: list[int] | None = None) -> types.Datum:
    return types.Datum(model_input=model_input, loss_fn_inputs={
        "target_tokens": targets or [1] * len(weights), "weights": weights})


def sdk_refusals(tc: tinker.TrainingClient, data: list[types.Datum]):
    """(what, call, words the 400 must contain): the SDK cases that used to wedge the run, and more."""
    ids = data[0].model_input.to_ints()
    n = len(ids)
    policy = {"target_tokens": data[0].loss_fn_inputs["target_tokens"], "logprobs": [-1.0] * n, "advantages": [1.0] * n}
    return [
        ("token id -1", lambda: tc.forward([_datum(types.ModelInput.from_ints([-1, 5]), [1.0, 1.0])],
                                          "cross_entropy"), "greater than or equal to 0"),
        ("learning_rate=-1", lambda: tc.optim_step(types.AdamParams(learning_rate=-1)), "learning_rate"),
        ("learning_rate=1e30", lambda: tc.optim_step(types.AdamParams(learning_rate=1e30)), "learning_rate"),
        ("beta2=1.0", lambda: tc.optim_step(types.AdamParams(beta2=1.0)), "beta2"),
        ("eps=0", lambda: tc.optim_step(types.AdamParams(eps=0.0)), "eps"),
        ('save_state("a/b")', lambda: tc.save_state("a/b"), "'a/b'"),
        ('save_state("..")', lambda: tc.save_state(".."), "'..'"),
        ('save_weights_for_sampler("x/y")', lambda: tc.save_weights_for_sampler("x/y"), "'x/y'"),
        ("NaN weights", lambda: tc.forward_backward([_datum(data[0].model_input, [float("nan")] * n)],
                                                   "cross_entropy"), "must be finite"),
        ("1e30 weights", lambda: tc.forward_backward([_datum(data[0].model_input, [1e30] * n)], "cross_entropy"),
         "over the limit"),
        ("-inf sampler logprobs", lambda: tc.forward_backward([types.Datum(
            model_input=data[0].model_input, loss_fn_inputs=dict(policy, logprobs=[float("-inf")] * n))],
            "importance_sampling"), "must be finite"),
        ("NaN advantages", lambda: tc.forward_backward([types.Datum(
            model_input=data[0].model_input, loss_fn_inputs=dict(policy, advantages=[float("nan")] * n))], "ppo"),
         "must be finite"),
        ("NaN clip threshold", lambda: tc.forward_backward([types.Datum(model_input=data[0].model_input,
                                                                        loss_fn_inputs=policy)], "ppo",
                                                           loss_fn_config={"clip_low_threshold": float("nan")}),
         "clip_low_threshold"),
        ("inverted clip thresholds", lambda: tc.forward_backward(
            [types.Datum(model_input=data[0].model_input, loss_fn_inputs=policy)], "ppo",
            loss_fn_config={"clip_low_threshold": 1.5, "clip_high_threshold": 0.5}), "clip_low_threshold"),
        ("dro beta=-1e30", lambda: tc.forward_backward([types.Datum(model_input=data[0].model_input,
                                                                    loss_fn_inputs=policy)], "dro",
                                                       loss_fn_config={"beta": -1e30}), "beta"),
    ]


def test_each_sdk_refusal_is_a_400_and_the_same_clients_next_call_goes_on(client_and_data):
    tc, data = client_and_data
    for what, call, words in sdk_refusals(tc, data):
        with pytest.raises(tinker.BadRequestError, match=words):
            call().result(timeout=NEXT_CALL_SECONDS)
        out = tc.forward(data, "cross_entropy").result(timeout=NEXT_CALL_SECONDS)
        assert np.isfinite(out.metrics["loss:sum"]), what
    tc.forward_backward(data, "cross_entropy").result(timeout=NEXT_CALL_SECONDS)
    assert np.isfinite(tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(
        timeout=NEXT_CALL_SECONDS).metrics["grad_norm:mean"])
    assert tc.save_state("after-refusals").result(timeout=NEXT_CALL_SECONDS).path.endswith("after-refusals")


def test_sampling_refusals_are_400s_that_name_the_field(service_client, client_and_data):
    tc, data = client_and_data
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result()
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:4])
    for params, words in [(dict(temperature=1e9), "temperature"), (dict(seed=2**70), "seed"),
                          (dict(max_tokens=2048), "max-sampled-tokens-per-request")]:
        with pytest.raises(tinker.BadRequestError, match=words):
            sampler.sample(prompt, num_samples=256, sampling_params=types.SamplingParams(**params)).result()
    assert sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)).result().sequences


def test_non_finite_json_numbers_are_400s(server):
    # The SDK cannot send them, but a raw client can (Python's json writes Infinity and NaN).
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=30) as http:
        for body in (b'{"model_id": "m", "seq_id": 1, "adam_params": {"learning_rate": NaN}}',
                     b'{"model_id": "m", "seq_id": 1, "adam_params": {"learning_rate": Infinity}}'):
            response = http.post("/api/v1/optim_step", content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 400 and "learning_rate" in response.json()["detail"]


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def _mutated(body: bytes, mutate) -> bytes:
    message = pb.ForwardBackwardRequest.FromString(body)
    mutate(message)
    return message.SerializeToString()


def _add_image(message, image_format: str) -> None:
    chunk = message.data[0].model_input.add()
    chunk.image.data, chunk.image.format = _png(), image_format


RAW_REFUSALS = [
    ("an image format other than png/jpeg", lambda m: _add_image(m, "gif"), "format"),
    ("an empty chunk", lambda m: m.data[0].model_input.add(), "empty chunk"),
    ("a negative tensor shape", lambda m: m.data[0].loss_fn_inputs["weights"].shape.extend([-3]), "negative"),
    ("NaN in a dense tensor", lambda m: setattr(m.data[0].loss_fn_inputs["weights"], "dense",
                                                np.full(len(m.data[0].loss_fn_inputs["weights"].dense) // 4, np.nan,
                                                        dtype="<f4").tobytes()), "finite"),
    ("a ragged dense tensor", lambda m: setattr(m.data[0].loss_fn_inputs["weights"], "dense", b"\x00\x00\x80"),
     "whole number"),
    ("no datum", lambda m: m.ClearField("data"), "at least one datum"),
    ("an unknown loss", lambda m: setattr(m, "loss_fn", "nonsense"), "unsupported loss_fn"),
    ("a NaN loss_fn_config", lambda m: m.loss_fn_config.__setitem__("beta", float("nan")), "finite"),
]


def test_raw_protobuf_refusals_take_their_seq_id_and_the_run_goes_on(server, service_client, client_and_data):
    _, data = client_and_data
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=62).result()

    def body(seq_id: int, mutate=None, compress=False) -> tuple[bytes, dict]:
        raw = forward_backward_request_to_proto(types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data[:1], loss_fn="cross_entropy"),
            model_id=tc.model_id, seq_id=seq_id)).SerializeToString()
        raw = _mutated(raw, mutate) if mutate else raw
        headers = {"Content-Type": "application/x-protobuf"}
        if compress:
            raw, headers["Content-Encoding"] = zstandard.ZstdCompressor().compress(raw), "zstd"
        return raw, headers

    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=NEXT_CALL_SECONDS) as http:
        seq_id = 0
        for what, mutate, words in RAW_REFUSALS:
            seq_id += 1
            content, headers = body(seq_id, mutate, compress=seq_id % 2 == 0)
            refused = http.post("/api/v1/forward_backward", content=content, headers=headers)
            assert refused.status_code == 400 and words in refused.json()["detail"], (what, refused.text)
            assert http.post("/api/v1/forward_backward", content=content, headers=headers).status_code == 400
            seq_id += 1
            content, headers = body(seq_id)
            request_id = http.post("/api/v1/forward_backward", content=content, headers=headers).json()["request_id"]
            while (poll := http.post("/api/v1/retrieve_future", json={"request_id": request_id})).status_code == 408:
                pass
            assert poll.status_code == 200 and poll.headers["content-type"] == "application/x-protobuf", what
        assert http.get("/api/v1/healthz").status_code == 200


def test_sampling_limits_are_reported_and_a_request_over_one_is_refused_naming_its_flag(server, client_and_data):
    tc, data = client_and_data
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=NEXT_CALL_SECONDS) as http:
        limits = http.get("/api/v1/get_server_capabilities").json()["limits"]
    assert (limits["max_num_samples"], limits["max_sample_tokens"]) == (256, 8192)  # the flags' defaults
    assert limits["max_sequence_length"] == 32768 and limits["max_images_per_prompt"] > 0
    assert limits["max_datums_per_request"] == 4096
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=NEXT_CALL_SECONDS)
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:4])
    for num_samples, max_tokens, flag in [(limits["max_num_samples"] + 1, 2, "--max-num-samples"),
                                          (1, limits["max_sample_tokens"] + 1, "--max-sample-tokens")]:
        with pytest.raises(tinker.BadRequestError, match=flag):
            sampler.sample(prompt, num_samples=num_samples,
                           sampling_params=types.SamplingParams(max_tokens=max_tokens)).result(timeout=NEXT_CALL_SECONDS)
    assert sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)).result(
        timeout=NEXT_CALL_SECONDS).sequences
