"""On a CUDA device in bf16 (run on the lent GPU machine: `pytest -m gpu tests/gpu/test_decode_graphs_gpu.py`): the
embedded engine's decode steps replayed as CUDA graphs sample what the same steps run eagerly sample, each
bucket's graph is captured once and replayed after (also when an RL step brings a new adapter of the same rank),
and a burst of short requests goes through.

Stated tolerance: the same kernels run in both (a graph replays what its capture recorded), so the tokens are
equal and the logprobs within 2e-2 (bf16; only the warm-up of a capture runs on another stream).
"""

import pytest
import torch

from server.config import ModelConfig
from server.lora.layers import apply_lora_wrappers
from server.sampling.decode_graphs import MAX_GRAPHS, DecodeSettings
from server.sampling.embedded import EmbeddedEngine, load_engine_model
from server.sampling.types import AdapterRef, SamplingOptions, SamplingRequest
from server.wire.model_input import EncodedTextChunk, ImageChunk

from support.engines import adapter, engines_by_mode, join_while_decoding
from support.vision import encode, load, noise_image, render_prompt as prompt

pytestmark = pytest.mark.gpu

BASE_MODEL = "builtin:tiny-qwen2-vl"


@pytest.fixture(scope="module")
def wrapped(models_dir):
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device")
    base = load(BASE_MODEL, models_dir)
    targets, _ = apply_lora_wrappers(base.model, base.family)
    return base, targets


@pytest.fixture(scope="module")
def engines(models_dir, wrapped):
    config = ModelConfig(base_model=BASE_MODEL, model_path=None, model_cache_dir=models_dir, device="cuda",
                         dtype="bfloat16")
    def make(mode: str) -> EmbeddedEngine:
        return EmbeddedEngine(lambda: load_engine_model(config, 1 << 26), decode=DecodeSettings(mode))

    with engines_by_mode(make, ("graphs", "static")) as made:
        yield made


def requests(base, targets, seed: int) -> list[SamplingRequest]:
    """Greedy requests of two adapters (new objects each call, as an RL loop's steps bring) and the base model,
    one with an image."""
    ids = base.tokenizer.encode
    adapters = [AdapterRef(name=f"a{seed}-{rank}", directory=None,
                           weights=adapter(targets, seed + rank, rank).frozen_copy("cuda")) for rank in (4, 8)]
    image = [EncodedTextChunk(tokens=ids("Look:<|vision_start|>")),
             ImageChunk(data=encode(noise_image(64, 64, seed=1)), format="png"),
             EncodedTextChunk(tokens=ids("<|vision_end|>What is it?"))]
    greedy = SamplingOptions(max_tokens=12, temperature=0.0)
    return [SamplingRequest(prompt=prompt(base, EncodedTextChunk(tokens=ids("Count with me:"))), options=greedy,
                            num_samples=2, adapter=adapters[0]),
            SamplingRequest(prompt=prompt(base, *image), options=SamplingOptions(max_tokens=6, temperature=0.0),
                            adapter=adapters[1]),
            SamplingRequest(prompt=prompt(base, EncodedTextChunk(tokens=ids("A longer prompt about shapes " * 20))),
                            options=SamplingOptions(max_tokens=9, temperature=0.0), num_samples=3),
            SamplingRequest(prompt=prompt(base, EncodedTextChunk(tokens=ids("Three at once"))),
                            options=SamplingOptions(max_tokens=4, temperature=0.0), adapter=adapters[0])]


def run(engine: EmbeddedEngine, batch: list[SamplingRequest]) -> list:
    return join_while_decoding(engine, batch[0], batch[1:])


def test_graph_replays_sample_what_eager_steps_sample_and_capture_each_bucket_once(engines, wrapped):
    base, targets = wrapped
    batch = requests(base, targets, seed=1)
    for _ in range(2):  # the first grows the cache (dropping the graphs over the old buffers), the second recaptures
        run(engines["graphs"], batch)
    runner = engines["graphs"].batch.decoder
    captures, replays = runner.captures, runner.replays
    eager = run(engines["static"], batch)
    replayed = run(engines["graphs"], batch)
    for got, want in zip(replayed, eager):
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
        for mine, theirs in zip(got.sequences, want.sequences):
            torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=2e-2, rtol=0)
    print("captures", runner.captures, "replays", runner.replays, "buckets", list(runner.graphs))
    assert runner.graphs_enabled and len(runner.graphs) > 0
    assert runner.captures == captures and runner.replays > replays
    assert engines["static"].batch.decoder.captures == 0
    # The next RL step: new adapters of the same ranks take the same columns, so the same graphs replay.
    replays = runner.replays
    again = run(engines["graphs"], requests(base, targets, seed=2))
    assert runner.captures == captures and runner.replays > replays
    assert all(len(output.sequences[0].tokens) > 0 for output in again)


def test_a_burst_of_short_requests_replays_a_bounded_set_of_graphs(engines, wrapped):
    base, _ = wrapped
    ids = base.tokenizer.encode
    options = SamplingOptions(max_tokens=4, seed=7)
    burst = [SamplingRequest(prompt=prompt(base, EncodedTextChunk(tokens=ids(f"Episode {index}: go"))),
                             options=options) for index in range(256)]
    runner = engines["graphs"].batch.decoder
    replays = runner.replays
    futures = [engines["graphs"].submit(request) for request in burst]
    outputs = [future.result() for future in futures]
    assert all(len(output.sequences[0].tokens) == 4 for output in outputs)
    print("captures", runner.captures, "replays", runner.replays - replays)
    assert runner.graphs_enabled and len(runner.graphs) <= MAX_GRAPHS
    assert runner.replays - replays > 0
