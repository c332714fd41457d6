"""The OpenAI-compatible API (/oai/api/v1) with the official `openai` client against the README's live server
(tiny Qwen2-VL): chat with an image rendered as the chat template writes it and sampled as the SDK samples
it, streamed and not; text completions with n, seeds, stops and logprobs; a trained checkpoint by its
tinker:// path, for its tenant only; and bad input refused with a 4xx that leaves the server serving. A server
in this process, its engine held at a decode step, shows a stream's tokens sent as they are sampled."""

import base64
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import uvicorn
from PIL import Image
from tinker import types

from client_compat.chat import ChatRenderer
from server.app import create_app
from server.config import parse_config
from server.models.builtin import ensure_builtin_model
from server.sampling import embedded
from support.engines import with_logged_forwards
from support.live_server import LiveServer, free_port
from support.sdk import supervised_datum
from support.vision import encode

MODEL = "builtin:tiny-qwen2-vl"
QUESTION = "What colour is this square?"


@pytest.fixture(scope="module")
def tenant(first_start_server: LiveServer):
    """A tenant of its own on the shared server: its key, its SDK client and its OpenAI client."""
    key = first_start_server.create_key("oai")
    with first_start_server.service_client(key) as service:
        yield key, service, openai.OpenAI(base_url=f"{first_start_server.url}/oai/api/v1", api_key=key,
                                          max_retries=0)


def image_message(image: Image.Image) -> dict:
    url = "data:image/png;base64," + base64.b64encode(encode(image)).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": QUESTION}]}


def test_a_chat_with_an_image_is_the_chat_template_sampled_as_the_sdk_samples_it_streamed_or_not(tenant, models_dir):
    _, service, client = tenant
    image = Image.new("RGB", (56, 40), (200, 30, 30))
    renderer = ChatRenderer.from_model_dir(ensure_builtin_model(MODEL.removeprefix("builtin:"), models_dir))
    prompt = types.ModelInput(chunks=renderer.render([{"role": "user", "content": [
        {"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]))
    sampler = service.create_sampling_client(base_model=MODEL).result()
    expected = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]

    answer = client.chat.completions.create(model=MODEL, messages=[image_message(image)], max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=2)
    choice = answer.choices[0]
    assert choice.message.content == renderer.tokenizer.decode(expected.tokens, skip_special_tokens=True)
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(expected.logprobs, abs=1e-3)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-4
               for t in choice.logprobs.content)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt.length, len(expected.tokens))
    assert choice.finish_reason == ("stop" if expected.stop_reason == "stop" else "length")

    events = list(client.chat.completions.create(model=MODEL, messages=[image_message(image)], max_tokens=6,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == choice.message.content
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == choice.finish_reason
    assert events[-1].usage.total_tokens == answer.usage.total_tokens


def test_text_completions_take_n_seeds_stops_and_logprobs_and_stream(tenant):
    _, _, client = tenant
    asked = dict(model=MODEL, prompt="Hello world, the model", max_tokens=8, n=3, seed=7, temperature=1.0)
    first, again = client.completions.create(**asked, logprobs=2), client.completions.create(**asked)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # each of the n samples draws its own tokens
    logprobs = first.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert first.usage.completion_tokens == 3 * 8

    stop = max((c.text for c in first.choices), key=len)[2:4]
    stopped = client.completions.create(**asked, stop=[stop])
    assert [c.text for c in stopped.choices] == [c.text.split(stop)[0] for c in first.choices]
    assert [c.finish_reason for c in stopped.choices] == ["stop" if stop in c.text else c.finish_reason
                                                          for c in first.choices]

    streamed = list(client.completions.create(**asked, stop=[stop], stream=True))
    texts = ["".join(e.choices[0].text for e in streamed if e.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in stopped.choices]  # never a character past the stop string
    assert [[e.choices[0].finish_reason for e in streamed if e.choices[0].index == i][-1]
            for i in range(3)] == [c.finish_reason for c in stopped.choices]
    batched = client.completions.create(model=MODEL, prompt=["One two", "three four"], max_tokens=2, n=2)
    assert [c.index for c in batched.choices] == [0, 1, 2, 3]


def test_a_trained_checkpoint_is_sampled_by_its_path_and_listed_for_its_tenant_only(first_start_server, tenant):
    _, service, client = tenant
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    datum = supervised_datum(training.get_tokenizer(), "One two three four five six seven.")
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = training.save_weights_for_sampler("oai").result().path
    prompt = types.ModelInput.from_ints(datum.model_input.to_ints()[:4])
    expected = service.create_sampling_client(model_path=path).result().sample(
        prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result().sequences[0]

    for model in (path, f"{MODEL};{path}"):
        done = client.completions.create(model=model, prompt=prompt.to_ints(), max_tokens=4, temperature=0,
                                         logprobs=0)
        assert done.choices[0].logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-3)
        assert done.model == model
    base = client.completions.create(model=MODEL, prompt=prompt.to_ints(), max_tokens=4, temperature=0, logprobs=0)
    assert base.choices[0].logprobs.token_logprobs != pytest.approx(expected.logprobs, abs=1e-3)
    assert path in [m.id for m in client.models.list()]

    other = openai.OpenAI(base_url=client.base_url, api_key=first_start_server.api_key, max_retries=0)
    assert path not in [m.id for m in other.models.list()]
    with pytest.raises(openai.NotFoundError, match="no checkpoint"):
        other.completions.create(model=path, prompt="One two", max_tokens=2)


def test_bad_requests_get_a_4xx_that_names_the_problem_and_the_server_keeps_serving(first_start_server, tenant):
    _, _, client = tenant
    message = image_message(Image.new("RGB", (32, 32)))
    refused = [
        (openai.BadRequestError, "not a data:image", dict(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])),
        (openai.BadRequestError, "could not be decoded", dict(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}])),
        (openai.BadRequestError, "tools", dict(messages=[message], tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}])),
        (openai.BadRequestError, "max-sample-tokens", dict(messages=[message], max_tokens=10**9)),
        (openai.BadRequestError, "top_logprobs", dict(messages=[message], top_logprobs=2)),
        (openai.NotFoundError, "not served here", dict(messages=[message], model="gpt-4o")),
    ]
    for kind, words, body in refused:
        with pytest.raises(kind, match=words) as caught:
            client.chat.completions.create(**{"model": MODEL, **body})
        assert caught.value.type in ("invalid_request_error", "not_found_error")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="tml-not-a-key", max_retries=0).models.list()
    assert client.chat.completions.create(model=MODEL, messages=[message], max_tokens=1).choices[0].message


@contextlib.contextmanager
def server_in_this_process(data_dir: Path, models_dir: Path) -> Iterator[str]:
    """The server (tiny Qwen3, no keys) on uvicorn in a thread of the test's process: its engine can be held."""
    data_dir.mkdir()
    (data_dir / "models").symlink_to(models_dir, target_is_directory=True)
    port = free_port()
    config = parse_config(["--base-model", "builtin:tiny-qwen3", "--data-dir", str(data_dir), "--port", str(port),
                           "--auth", "none", "--sampler-process", "off"])
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        threading.Event().wait(0.05)
    try:
        yield f"http://127.0.0.1:{port}/oai/api/v1"
    finally:
        server.should_exit = True
        thread.join()


def test_a_stream_sends_each_token_as_the_engine_samples_it(models_dir, tmp_path, monkeypatch):
    forwards, released = [], threading.Event()

    def hold(engine_model, call):  # the third forward (the second decode step) waits for the client's first token
        forwards.append(call)
        if len(forwards) == 3:
            assert released.wait(timeout=60), "no token reached the client while the engine was held"

    load = embedded.load_engine_model
    monkeypatch.setattr(embedded, "load_engine_model", lambda *args: with_logged_forwards(load(*args), hold))
    asked = dict(model="builtin:tiny-qwen3", messages=[{"role": "user", "content": "Count to ten."}], max_tokens=8,
                 seed=3, temperature=1.0, logprobs=True)
    with server_in_this_process(tmp_path / "data", models_dir) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        try:
            stream = client.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True})
            events = []
            for event in stream:  # the role, then the first sampled token (with its logprob)
                events.append(event)
                if event.choices and event.choices[0].logprobs is not None:
                    break
            assert not released.is_set() and len(forwards) <= 3  # the engine has not gone past the held step
            released.set()
            events += list(stream)
        finally:
            released.set()
        whole = client.chat.completions.create(**asked)
    assert len(forwards) > 3 and whole.usage.completion_tokens == 8  # the request did run past the held step
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == whole.choices[0].message.content
    assert [t.logprob for e in events if e.choices and e.choices[0].logprobs for t in e.choices[0].logprobs.content] \
        == pytest.approx([t.logprob for t in whole.choices[0].logprobs.content], abs=1e-4)
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == whole.choices[0].finish_reason
    assert events[-1].usage == whole.usage
