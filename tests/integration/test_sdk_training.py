"""Supervised training through the real SDK: loss falls, forward == forward_backward, chunking,
exactly-once seq_ids, isolation between runs, and every loss against a plain-torch reference."""


import httpx
import numpy as np
import pytest
import torch
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from support.sdk import SENTENCES, forward_logprobs, prompt_of, supervised_datum

from support.live_server import BASE_MODEL, start_server

ADAM = types.AdamParams(learning_rate=5e-3)


@pytest.fixture(scope="module")
def tokenizer(service_client):
    return service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result().get_tokenizer()


def test_supervised_loop_loss_falls(service_client, tokenizer):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
    data = [supervised_datum(tokenizer, s) for s in SENTENCES[:3]]
    losses = []
    for _ in range(8):
        out = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=4e-3)).result()
        losses.append(out.metrics["loss:sum"])
        assert [list(o["logprobs"].shape) for o in out.loss_fn_outputs] == [[d.model_input.length] for d in data]
    assert losses[-1] < 0.6 * losses[0] and losses == sorted(losses, reverse=True), losses


def test_forward_returns_the_same_logprobs_as_forward_backward(service_client, tokenizer):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    data = [supervised_datum(tokenizer, s) for s in SENTENCES[:2]]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    forward = tc.forward(data, "cross_entropy").result()
    backward = tc.forward_backward(data, "cross_entropy").result()
    for f, b in zip(forward.loss_fn_outputs, backward.loss_fn_outputs):
        np.testing.assert_array_equal(f["logprobs"].tolist(), b["logprobs"].tolist())
        np.testing.assert_array_equal(f["elementwise_loss"].tolist(), b["elementwise_loss"].tolist())
    assert forward.metrics["loss:sum"] == pytest.approx(backward.metrics["loss:sum"], rel=1e-6)


def test_forward_backward_split_into_chunks_gives_the_same_update_as_one_call(
        server, service_client, tokenizer, models_dir, tmp_path):
    # A second server whose client/config makes the SDK send 2 datums per request (3 requests,
    # sent concurrently, first chunk last).
    chunked = start_server(tmp_path / "chunked", f"sqlite:///{tmp_path}/chunked.db", models_dir,
                           "--fwdbwd-chunk-len", "2")
    try:
        data = [supervised_datum(tokenizer, s) for s in SENTENCES]
        results = []
        for client in (service_client, chunked.service_client()):
            tc = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
            out = tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(ADAM).result()
            results.append((out, forward_logprobs(tc, data)))
        (one_out, one_after), (split_out, split_after) = results
        assert split_out.metrics["loss:sum"] == pytest.approx(one_out.metrics["loss:sum"], rel=1e-5)
        assert len(split_out.loss_fn_outputs) == len(data)
        for a, b in zip(one_after, split_after):
            np.testing.assert_allclose(a, b, atol=1e-5)
        # The update really changed the model, so equal logprobs mean equal updates.
        before = forward_logprobs(service_client.create_lora_training_client(
            base_model=BASE_MODEL, rank=4, seed=3).result(), data)
        assert max(np.abs(a - b).max() for a, b in zip(before, one_after)) > 1e-3
    finally:
        chunked.stop()


def test_a_repeated_seq_id_is_not_applied_twice(server, service_client, tokenizer):
    data = [supervised_datum(tokenizer, s) for s in SENTENCES[:2]]
    # Reference: one forward_backward and one optim_step through the SDK.
    reference = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4).result()
    reference.forward_backward(data, "cross_entropy").result()
    reference.optim_step(ADAM).result()
    expected = forward_logprobs(reference, data)

    # Same run by raw HTTP, every request sent twice with the same seq_id (a lost-response retry); the
    # forward_backward the second time zstd-compressed, as the SDK may send it: the same request.
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4).result()
    headers = server.headers()
    fwdbwd = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=tc.model_id, seq_id=1)).SerializeToString()
    optim = {"model_id": tc.model_id, "seq_id": 2, "adam_params": ADAM.model_dump(), "type": "optim_step"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        ids = []
        for encoding in (None, "zstd"):
            content = zstandard.ZstdCompressor().compress(fwdbwd) if encoding else fwdbwd
            ids.append(http.post("/api/v1/forward_backward", content=content, headers={
                "Content-Type": "application/x-protobuf", **({"Content-Encoding": encoding} if encoding else {})
            }).json()["request_id"])
            ids.append(http.post("/api/v1/optim_step", json=optim).json()["request_id"])
        assert ids[0] == ids[2] and ids[1] == ids[3]
        save = {"model_id": tc.model_id, "seq_id": 3, "path": "deduplicated", "type": "save_weights_for_sampler"}
        ids.append(http.post("/api/v1/save_weights_for_sampler", json=save).json()["request_id"])
        for request_id in ids:
            while (poll := http.post("/api/v1/retrieve_future", json={"request_id": request_id})).status_code == 408:
                pass
            assert "error" not in poll.text
        # The same seq_id with a different payload is a conflict, not a silent replay.
        conflicting = dict(optim, adam_params=dict(optim["adam_params"], learning_rate=1.0))
        response = http.post("/api/v1/optim_step", json=conflicting)
        assert response.status_code == 409 and "seq_id 2" in response.json()["detail"]
    sampler = service_client.create_sampling_client(
        model_path=f"tinker://{tc.model_id}/sampler_weights/deduplicated").result()
    for datum, reference_logprobs in zip(data, expected):
        computed = sampler.compute_logprobs(types.ModelInput.from_ints(prompt_of(datum))).result()
        np.testing.assert_allclose(computed[1:], reference_logprobs, atol=1e-5)


def test_two_training_clients_do_not_disturb_each_other(service_client, tokenizer):
    data_a = [supervised_datum(tokenizer, s) for s in SENTENCES[:2]]
    data_b = [supervised_datum(tokenizer, s) for s in SENTENCES[2:5]]

    def train(tc, data, steps):
        for _ in range(steps):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(ADAM).result()

    alone_a = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    train(alone_a, data_a, 2)
    alone_b = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=6).result()
    train(alone_b, data_b, 2)

    a = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    b = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=6).result()
    for _ in range(2):  # interleaved and in flight together
        futures = [a.forward_backward(data_a, "cross_entropy"), b.forward_backward(data_b, "cross_entropy")]
        futures += [a.optim_step(ADAM), b.optim_step(ADAM)]
        [f.result() for f in futures]
    for x, y in zip(forward_logprobs(alone_a, data_a), forward_logprobs(a, data_a)):
        np.testing.assert_allclose(x, y, atol=1e-6)
    for x, y in zip(forward_logprobs(alone_b, data_b), forward_logprobs(b, data_b)):
        np.testing.assert_allclose(x, y, atol=1e-6)


def _reference_elementwise(loss_fn: str, logprobs, inputs, config):
    """Tinker's loss formulas, written out independently in plain torch."""
    q, advantages = inputs["logprobs"], inputs["advantages"]
    ratio = torch.exp(logprobs - q)
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    if loss_fn == "ppo":
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        return -torch.min(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    if loss_fn == "cispo":
        low, high = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0)
        return -torch.clamp(ratio, low, high) * logprobs * advantages
    if loss_fn == "dro":
        beta = config.get("beta", 0.05)
        return -(logprobs * advantages - 0.5 * beta * (logprobs - q) ** 2)
    raise AssertionError(loss_fn)


@pytest.mark.parametrize("loss_fn,config", [
    ("cross_entropy", None),
    ("importance_sampling", None),
    ("ppo", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
    ("dro", {"beta": 0.3}),
])
def test_every_loss_matches_a_plain_torch_reference(service_client, tokenizer, loss_fn, config):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=7).result()
    texts = SENTENCES[:3]
    base = [supervised_datum(tokenizer, s) for s in texts]
    current = forward_logprobs(tc, base)
    rng = np.random.default_rng(0)
    data, references = [], []
    for datum, logprobs in zip(base, current):
        n = len(logprobs)
        targets = datum.loss_fn_inputs["target_tokens"].tolist()
        if loss_fn == "cross_entropy":
            weights = rng.normal(size=n).astype(np.float32)  # negative weights included
            inputs = {"target_tokens": targets, "weights": weights.tolist()}
            references.append(-torch.tensor(logprobs) * torch.tensor(weights, dtype=torch.float64))
        else:
            sampler_logprobs = (logprobs + rng.normal(scale=0.3, size=n)).astype(np.float32)
            advantages = rng.normal(size=n).astype(np.float32)
            inputs = {"target_tokens": targets, "logprobs": sampler_logprobs.tolist(),
                      "advantages": advantages.tolist()}
            tensors = {"logprobs": torch.tensor(sampler_logprobs, dtype=torch.float64),
                       "advantages": torch.tensor(advantages, dtype=torch.float64)}
            references.append(_reference_elementwise(loss_fn, torch.tensor(logprobs), tensors, config or {}))
        data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    out = tc.forward_backward(data, loss_fn, loss_fn_config=config).result()
    for output, reference in zip(out.loss_fn_outputs, references):
        np.testing.assert_allclose(output["elementwise_loss"].tolist(), reference.numpy(), atol=1e-4, rtol=1e-4)
    assert out.metrics["loss:sum"] == pytest.approx(float(sum(r.sum() for r in references)), abs=1e-3, rel=1e-4)


def test_forward_backward_custom_runs_on_the_client(service_client, tokenizer):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=8).result()
    data = [supervised_datum(tokenizer, s) for s in SENTENCES[:2]]

    def mean_nll(data, logprobs_list):
        loss = -sum(lp.sum() for lp in logprobs_list) / sum(len(lp) for lp in logprobs_list)
        return loss, {"mean_nll:mean": float(loss.detach())}

    out = tc.forward_backward_custom(data, mean_nll).result()
    total = sum(len(d.model_input.to_ints()) for d in data)
    nll = -sum(lp.sum() for lp in forward_logprobs(tc, data)) / total
    assert out.metrics["loss:sum"] == pytest.approx(nll, rel=1e-4)
    tc.optim_step(ADAM).result()
    assert -sum(lp.sum() for lp in forward_logprobs(tc, data)) / total < nll
