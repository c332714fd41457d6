"""The embedded engine's prefix cache: a conversation's next turn (its last prompt, the completion, a new
observation with an image) runs only its new positions and samples exactly what an engine without the cache
samples; a prefix is never shared across adapters and never ends inside an image; the cache keeps a
conversation once (a turn takes over the last one's entry) and stays within its bytes, least recently used
out first. The tiny Qwen2-VL, greedy, against a second engine without the cache."""

import numpy as np
import pytest
import torch

from server.config import ImageConfig
from server.lora.layers import apply_lora_wrappers
from server.rendering.chunks import RenderedInput, render_model_input
from server.sampling.embedded import EmbeddedEngine
from server.sampling.prefix_cache import BLOCK_TOKENS, PrefixCache, block_keys, content_ids
from server.sampling.types import AdapterRef, LogprobOptions, SamplingOptions, SamplingRequest
from server.wire.model_input import EncodedTextChunk, ImageChunk, ModelInput

from support.engines import adapter, logged_engine
from support.vision import context_for, encode, load, noise_image

BASE_MODEL = "builtin:tiny-qwen2-vl"
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0)


def engine_for(models_dir, prefix_cache_bytes: int) -> tuple[EmbeddedEngine, list[int]]:
    """An engine, and the list its forwards log their input width to (positions run per row)."""
    widths = []
    engine = logged_engine(BASE_MODEL, models_dir, lambda _, call: widths.append(call["input_ids"].shape[1]),
                           prefix_cache_bytes=prefix_cache_bytes)
    return engine, widths


@pytest.fixture(scope="module")
def engines(models_dir):
    cached, widths = engine_for(models_dir, 1 << 26)
    plain, _ = engine_for(models_dir, 0)
    yield cached, plain, widths
    cached.close()
    plain.close()


@pytest.fixture(scope="module")
def base(models_dir):
    return load(BASE_MODEL, models_dir)


def render(base, *chunks) -> RenderedInput:
    return render_model_input(ModelInput(chunks=list(chunks)), context_for(base, ImageConfig()), "prompt")


def text(base, words: str) -> EncodedTextChunk:
    return EncodedTextChunk(tokens=base.tokenizer.encode(words))


def image(base, seed: int, size: int = 64) -> list:
    ids = base.tokenizer.encode
    return [EncodedTextChunk(tokens=ids("<|vision_start|>")), ImageChunk(data=encode(noise_image(size, size, seed)),
                                                                         format="png"),
            EncodedTextChunk(tokens=ids("<|vision_end|>"))]


def sample(engine: EmbeddedEngine, prompt: RenderedInput, options: SamplingOptions = GREEDY, lora=None, name="base"):
    ref = None if lora is None else AdapterRef(name=name, directory=None, weights=lora)
    return engine.sample(SamplingRequest(prompt=prompt, options=options, adapter=ref,
                                         logprobs=LogprobOptions(topk_sample_logprobs=2)))


def assert_same(got, expected) -> None:
    for a, b in zip(got.sequences, expected.sequences, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert [[t for t, _ in row] for row in a.topk_logprobs] == [[t for t, _ in row] for row in b.topk_logprobs]


def test_a_conversations_next_turn_runs_only_its_new_positions_and_samples_as_without_the_cache(engines, base):
    cached, plain, widths = engines
    first = render(base, text(base, "<|im_start|>user\nLook at this picture and say what you see in it:"),
                   *image(base, 1), text(base, "<|im_end|>\n<|im_start|>assistant\n"))
    long_answer = SamplingOptions(max_tokens=24, temperature=0.0)
    turn = sample(cached, first, long_answer)
    assert turn.prompt_cache_hit_tokens == 0
    assert_same(turn, sample(plain, first, long_answer))
    completion = turn.sequences[0].tokens
    # The next turn: the last prompt, its completion, and a new observation with a new image.
    observation = render(base, text(base, "<|im_end|>\n<|im_start|>user\nAnd now this one:"), *image(base, 2),
                         text(base, "<|im_end|>\n<|im_start|>assistant\n"))
    second = RenderedInput(token_ids=first.token_ids + completion + observation.token_ids,
                           images=first.images + observation.images, image_token_id=first.image_token_id)
    widths.clear()
    got = sample(cached, second)
    seen = len(first.expanded_token_ids()) + len(completion) - 1  # the last sampled token never ran
    assert got.prompt_cache_hit_tokens == seen // BLOCK_TOKENS * BLOCK_TOKENS > len(first.expanded_token_ids())
    assert widths[0] == second.num_positions - got.prompt_cache_hit_tokens  # the prefill ran only the rest
    assert_same(got, sample(plain, second))


def test_a_prefix_is_never_taken_from_another_adapters_requests(engines, base, models_dir):
    cached, plain, _ = engines
    targets, _ = apply_lora_wrappers(load(BASE_MODEL, models_dir).model, base.family)
    one, other = adapter(targets, seed=1, rank=4), adapter(targets, seed=2, rank=4)
    prompt = render(base, text(base, "The same words for two runs, long enough to fill a few blocks of the cache."))
    assert sample(cached, prompt, lora=one, name="run-1").prompt_cache_hit_tokens == 0
    again = sample(cached, prompt, lora=one, name="run-1")
    assert again.prompt_cache_hit_tokens > 0
    assert_same(again, sample(plain, prompt, lora=one, name="run-1"))
    by_other = sample(cached, prompt, lora=other, name="run-2")
    assert by_other.prompt_cache_hit_tokens == 0
    assert_same(by_other, sample(plain, prompt, lora=other, name="run-2"))


def test_a_cached_prefix_never_ends_inside_an_image(engines, base):
    cached, plain, _ = engines
    ids = base.tokenizer.encode("An image starts here")
    before = EncodedTextChunk(tokens=ids[:8] + base.tokenizer.encode("<|vision_start|>"))
    prompt = render(base, before, *image(base, 3, size=112)[1:], text(base, "then a few words."))
    start = len(before.tokens)
    count = prompt.images[0].num_tokens
    assert start < BLOCK_TOKENS < start + count < prompt.num_positions  # the image spans a block boundary
    sample(cached, prompt)
    again = sample(cached, prompt)
    hit = again.prompt_cache_hit_tokens
    assert hit > 0 and not start < hit < start + count
    assert_same(again, sample(plain, prompt))


def keys_of(length: int, salt: str = "", offset: int = 0) -> list[bytes]:
    return block_keys(content_ids(list(range(offset, offset + length)), []), salt)


def kv(length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.zeros(2, length, 4)], [torch.zeros(2, length, 4)]


def test_a_longer_sequence_takes_over_the_shorter_ones_keys_and_the_shorter_one_is_dropped():
    cache = PrefixCache(max_bytes=1 << 20)
    cache.insert(keys_of(40), *kv(40))
    first_bytes = cache.nbytes
    cache.insert(keys_of(70), *kv(70))  # the next turn: the same start, longer
    segment, length = cache.longest(keys_of(70))
    assert length == 64 and segment.length == 70
    assert cache.longest(keys_of(40))[0] is segment  # its prefix is served by the longer one
    assert cache.nbytes == segment.nbytes > first_bytes  # the shorter one is gone


def test_keys_differ_by_adapter_and_by_image_content():
    assert keys_of(32, "run-1") != keys_of(32, "run-2")
    with_image = [content_ids(list(range(32)), [(sha, 4, 10)]) for sha in ("ab" * 32, "cd" * 32)]
    assert block_keys(with_image[0], "") != block_keys(with_image[1], "")
    assert block_keys(with_image[0], "")[1] != block_keys(with_image[1], "")[1]


def test_a_flood_of_unique_sequences_stays_within_the_byte_budget_newest_kept():
    one = PrefixCache(max_bytes=1 << 30)
    one.insert(keys_of(32), *kv(32))
    budget = 10 * one.nbytes
    cache = PrefixCache(max_bytes=budget)
    for index in range(1000):
        cache.insert(keys_of(32, offset=1000 * index), *kv(32))
        assert cache.nbytes <= budget
    assert cache.longest(keys_of(32, offset=999_000))[1] == 32  # the newest are there
    assert cache.longest(keys_of(32, offset=0))[1] == 0  # the oldest went first
