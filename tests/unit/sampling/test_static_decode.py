"""The embedded engine's static decode path (a preallocated batch cache in row and column buckets, run eagerly on
the CPU as CUDA graphs run it on a GPU) samples what the DynamicCache path samples: requests of several adapters
and an image prompt join while another decodes, leave early (a stop token, fewer tokens), and a conversation's
next turn comes from the prefix cache (kept sequences copied out of the static buffers). Capacities start so
small that the buffers grow, compact rows, shift columns right for a wider newcomer and left to reclaim padding.
The tiny Qwen2-VL in fp32."""

import pytest
import torch

from server.lora.adapter_buffers import AdapterBuffers
from server.lora.layers import AdapterStack, LoraLinear, apply_lora_wrappers, use_adapter_rows
from server.sampling.decode_graphs import DecodeSettings
from server.sampling.types import AdapterRef, SamplingOptions, SamplingRequest
from server.wire.model_input import EncodedTextChunk, ImageChunk

from support.engines import adapter, engines_by_mode, join_while_decoding, logged_engine
from support.vision import encode, load, noise_image, render_prompt as prompt

BASE_MODEL = "builtin:tiny-qwen2-vl"
WIDE = 60
"""Positions of the wide newcomer: the columns grow to 64, and once it leaves the long rows reach the end of
them with their padding free to reclaim."""


@pytest.fixture(scope="module")
def wrapped(models_dir):
    """The model with its own LoRA wrappers: the prompts' tokenizer and the adapters' targets."""
    base = load(BASE_MODEL, models_dir)
    targets, slot = apply_lora_wrappers(base.model, base.family)
    return base, targets, slot


@pytest.fixture(scope="module")
def engines(models_dir):
    def make(mode: str):
        return logged_engine(BASE_MODEL, models_dir, lambda *_: None, prefix_cache_bytes=1 << 24,
                             decode=DecodeSettings(mode, rows=1, columns=8, column_step=8))

    with engines_by_mode(make, ("static", "dynamic")) as made:
        yield made


def text(base, words: str, length: int | None = None) -> EncodedTextChunk:
    tokens = base.tokenizer.encode(words)
    return EncodedTextChunk(tokens=(tokens * length)[:length] if length else tokens)


def mix(engine, base, targets, stop_token: int) -> list:
    """A long request of two samples, then four more that join when it has sampled three tokens."""
    ids = base.tokenizer.encode
    adapters = [AdapterRef(name=f"a{seed}", directory=None, weights=adapter(targets, seed, rank))
                for seed, rank in [(1, 4), (2, 8)]]
    long = SamplingRequest(prompt=prompt(base, text(base, "Count with me:")),
                           options=SamplingOptions(max_tokens=24, seed=1), num_samples=2, adapter=adapters[0])
    image = [EncodedTextChunk(tokens=ids("Look:<|vision_start|>")),
             ImageChunk(data=encode(noise_image(64, 64, seed=1)), format="png"),
             EncodedTextChunk(tokens=ids("<|vision_end|>What is it?"))]
    later = [SamplingRequest(prompt=prompt(base, text(base, "A wide prompt about shapes.", WIDE)),
                             options=SamplingOptions(max_tokens=2, seed=2), adapter=adapters[1]),
             SamplingRequest(prompt=prompt(base, *image), options=SamplingOptions(max_tokens=9, seed=3),
                             num_samples=2, adapter=adapters[1]),
             SamplingRequest(prompt=prompt(base, text(base, "Stop here")),
                             options=SamplingOptions(max_tokens=8, temperature=0.0, stop_token_ids=(stop_token,))),
             SamplingRequest(prompt=prompt(base, text(base, "Three at once")),
                             options=SamplingOptions(max_tokens=5, seed=4, top_k=20, top_p=0.9), num_samples=3,
                             adapter=adapters[0])]
    return join_while_decoding(engine, long, later)


def assert_same(got, want) -> None:
    assert [(s.tokens, s.stop_reason) for s in got.sequences] == [(s.tokens, s.stop_reason) for s in want.sequences]
    for mine, theirs in zip(got.sequences, want.sequences):
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=1e-5, rtol=0)
    assert got.prompt_cache_hit_tokens == want.prompt_cache_hit_tokens


def test_the_static_path_samples_what_the_dynamic_one_does_through_growth_compaction_and_shifts(engines, wrapped):
    base, targets, _ = wrapped
    greedy = SamplingRequest(prompt=prompt(base, text(base, "Stop here")), options=SamplingOptions(max_tokens=8,
                                                                                               temperature=0.0))
    stop_token = engines["dynamic"].sample(greedy).sequences[0].tokens[2]
    results = {mode: mix(engine, base, targets, stop_token) for mode, engine in engines.items()}
    for got, want in zip(results["static"], results["dynamic"]):
        assert_same(got, want)
    assert results["static"][3].sequences[0].stop_reason == "stop"
    moves = engines["static"].batch.cache.moves
    assert moves["grow"] and moves["compact"] and moves["shift right"] and moves["reclaim"], moves


def test_a_conversations_next_turn_comes_from_the_static_buffers_and_samples_the_same(engines, wrapped):
    base = wrapped[0]
    first = SamplingRequest(prompt=prompt(base, text(base, "Tell me a story about a red square.")),
                            options=SamplingOptions(max_tokens=6, temperature=0.0))
    turns = {}
    for mode, engine in engines.items():
        reply = engine.sample(first)
        following = prompt(base, text(base, "Tell me a story about a red square."),
                           EncodedTextChunk(tokens=reply.sequences[0].tokens), text(base, "And then?"))
        turns[mode] = (reply, engine.sample(SamplingRequest(prompt=following, options=first.options)))
    assert_same(turns["static"][0], turns["dynamic"][0])
    assert_same(turns["static"][1], turns["dynamic"][1])
    assert turns["static"][1].prompt_cache_hit_tokens > 0


def test_adapter_buffers_keep_an_adapters_columns_and_replace_buffers_only_when_they_run_out(wrapped):
    _, targets, slot = wrapped
    buffers = AdapterBuffers(slot, torch.float32, torch.device("cpu"))
    kept, old, new, wider = (adapter(targets, seed, rank) for seed, rank in [(1, 4), (2, 4), (3, 4), (4, 8)])
    first = buffers.use([kept, old])
    generation = buffers.generation
    second = buffers.use([kept, new])  # an RL step's new adapter takes the columns of the one before
    assert buffers.generation == generation and second[id(kept)] == first[id(kept)]
    assert second[id(new)] == first[id(old)]
    layer = next(layer for layer in slot.layers if isinstance(layer, LoraLinear) and layer.name in new.lora_A)
    x = torch.randn(3, 1, layer.base.in_features)
    with use_adapter_rows(slot, buffers, torch.tensor([second[id(new)], -1, second[id(kept)]])):
        got = layer(x)
    with use_adapter_rows(slot, AdapterStack(slot, [kept, new, None], torch.float32), torch.tensor([1, 2, 0])):
        want = layer(x)
    torch.testing.assert_close(got, want)
    buffers.use([kept, new, wider])  # more columns than there are: new buffers
    assert buffers.generation == generation + 1
