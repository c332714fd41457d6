"""The embedded engine in a process of its own samples exactly what it samples in this process: the base model
and an in-memory adapter (its weights cross once, by name), text and image prompts, each token handed to the
request's on_token as it is here; a process that dies fails the requests it held with a 503 and the next
request starts a new one. Requests sent together cross the pipe together and come back each with its own answer;
one the child refuses off its engine thread is answered at once, and one that cannot be pickled fails alone.
The tiny Qwen2-VL on the CPU."""

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest

from server.config import ModelConfig, SamplerConfig
from server.errors import EngineUnavailable, NotFound
from server.lora.layers import apply_lora_wrappers
from server.sampling.adapters import SamplerAdapters
from server.sampling.embedded import EmbeddedEngine
from server.sampling.engine_process import EngineProcess
from server.sampling.types import AdapterRef, LogprobOptions, SamplingOptions, SamplingRequest
from server.wire.model_input import EncodedTextChunk, ImageChunk, ModelInput

from support.engines import adapter
from support.vision import context_for, encode, load, noise_image

BASE_MODEL = "builtin:tiny-qwen2-vl"
GREEDY = SamplingOptions(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def base(models_dir):
    return load(BASE_MODEL, models_dir)


@pytest.fixture(scope="module")
def engines(models_dir):
    model = ModelConfig(base_model=BASE_MODEL, model_path=None, model_cache_dir=models_dir)
    sampler = SamplerConfig()
    child = EngineProcess(model, 1 << 26, sampler)
    here = EmbeddedEngine.on_demand(model, 1 << 26, SamplerAdapters(sampler, "cpu"), sampler)
    yield child, here
    child.close()
    here.close()


def requests(base, models_dir) -> list[SamplingRequest]:
    from server.config import ImageConfig
    from server.rendering.chunks import render_model_input

    context = context_for(base, ImageConfig())
    ids = base.tokenizer.encode
    text = render_model_input(ModelInput(chunks=[EncodedTextChunk(tokens=ids("Say something about squares."))]),
                              context, "prompt")
    image = render_model_input(ModelInput(chunks=[
        EncodedTextChunk(tokens=ids("Look:<|vision_start|>")), ImageChunk(data=encode(noise_image(64, 64, 4)),
                                                                         format="png"),
        EncodedTextChunk(tokens=ids("<|vision_end|>What is it?"))]), context, "prompt")
    targets, _ = apply_lora_wrappers(load(BASE_MODEL, models_dir).model, base.family)
    lora = AdapterRef(name="snapshot-1", directory=None, weights=adapter(targets, seed=3, rank=4))
    return [SamplingRequest(prompt=prompt, options=GREEDY, adapter=ref, num_samples=2,
                            logprobs=LogprobOptions(prompt_logprobs=True))
            for prompt in (text, image) for ref in (None, lora)]


def test_the_engine_in_its_own_process_samples_what_it_samples_here(engines, base, models_dir):
    child, here = engines
    for request in requests(base, models_dir) * 2:  # the second time, the adapter is named, not sent
        streamed = {child: [], here: []}
        got, expected = (engine.sample(dataclasses.replace(request, on_token=lambda *token, engine=engine:
                                                           streamed[engine].append(token)))
                         for engine in (child, here))
        for a, b in zip(got.sequences, expected.sequences, strict=True):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        # Each token was handed to on_token as well, from the child across the pipe too.
        for engine, output in ((child, got), (here, expected)):
            assert [[(token, logprob) for sample, token, logprob, _ in streamed[engine] if sample == i]
                    for i in range(request.num_samples)] == [list(zip(s.tokens, s.logprobs)) for s in output.sequences]
        np.testing.assert_allclose(np.array(got.prompt_logprobs[1:]), np.array(expected.prompt_logprobs[1:]),
                                   atol=1e-5)
    child.forget("snapshot-1")  # dropped there too; a later request sends the weights again
    with_adapter = requests(base, models_dir)[1]
    assert child.sample(with_adapter).sequences[0].tokens == here.sample(with_adapter).sequences[0].tokens


def test_requests_sent_together_each_get_their_own_answer(engines, base, models_dir):
    child, here = engines
    burst = requests(base, models_dir)
    got = [future.result(timeout=120) for future in [child.submit(request) for request in burst]]
    expected = [future.result(timeout=120) for future in [here.submit(request) for request in burst]]
    for a, b in zip(got, expected, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]


def test_a_request_refused_off_the_engine_thread_is_answered_at_once(engines, base, models_dir):
    child, _ = engines
    gone = AdapterRef(name="gone", directory=Path("/nonexistent/checkpoint"), weights=None)
    # The child's adapter loader refuses it (no files): its answer does not wait for an engine step.
    with pytest.raises(NotFound, match="are gone"):
        child.submit(dataclasses.replace(requests(base, models_dir)[0], adapter=gone)).result(timeout=60)


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this cannot cross a pipe")


def test_a_request_that_cannot_cross_the_pipe_fails_alone(engines, base, models_dir):
    child, here = engines
    good, other = requests(base, models_dir)[:2]
    odd = dataclasses.replace(good, adapter=AdapterRef(name="odd", directory=Unpicklable(), weights=None))
    futures = [child.submit(request) for request in (good, odd, other)]  # queued together, sent together
    with pytest.raises(EngineUnavailable, match="could not be sent"):
        futures[1].result(timeout=60)
    for future, request in ((futures[0], good), (futures[2], other)):
        assert [s.tokens for s in future.result(timeout=120).sequences] == \
            [s.tokens for s in here.sample(request).sequences]


def test_a_process_that_dies_fails_what_it_held_and_the_next_request_starts_another(engines, base, models_dir):
    child, _ = engines
    request = requests(base, models_dir)[0]
    child.sample(request)
    long = SamplingRequest(prompt=request.prompt, options=SamplingOptions(max_tokens=4000, temperature=1.0))
    held = child.submit(long)
    child._child.process.kill()
    with pytest.raises(EngineUnavailable, match="process ended"):
        held.result(timeout=120)
    assert len(child.sample(request).sequences) == 2


def test_after_load_runs_once_on_the_engine_thread_with_the_model_loaded_before_the_first_answer(base, models_dir):
    # The engine's process freezes what it holds for good here (server/heap.py): once, after the model is there.
    model = ModelConfig(base_model=BASE_MODEL, model_path=None, model_cache_dir=models_dir)
    sampler = SamplerConfig()
    calls = []
    engine = EmbeddedEngine.on_demand(model, 1 << 26, SamplerAdapters(sampler, "cpu"), sampler,
                                      after_load=lambda: calls.append((threading.current_thread().name, engine.batch)))
    try:
        assert calls == []  # nothing loads before the first request
        request = requests(base, models_dir)[0]
        first = engine.sample(request)
        assert calls == [("embedded-sampler", None)]  # the batch is made after it
        assert engine.sample(request).sequences[0].tokens == first.sequences[0].tokens
    finally:
        engine.close()
    assert len(calls) == 1
