"""The embedded sampling engine, one request at a time, against a tiny random Qwen3 and plain full forwards."""

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from server.models.registry import family_for
from server.rendering.chunks import RenderedInput
from server.sampling.embedded import EmbeddedEngine
from server.sampling.embedded_batch import EngineModel
from server.sampling.types import LogprobOptions, PromptTargets, SampleOutput, SamplingOptions, SamplingRequest
from server.lora.layers import apply_lora_wrappers

# Tensor shape suffixes: T = prompt plus completion positions, V = vocabulary.

VOCAB_SIZE = 300
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64]
TEXT_PROMPT = RenderedInput(token_ids=PROMPT, images=[], image_token_id=None)


def random_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=32, vocab_size=VOCAB_SIZE)
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    """The reference copy; the engine runs its own (the same weights), so references never share its state."""
    return random_qwen3()


@pytest.fixture(scope="module")
def tokenizer():
    word_level = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB_SIZE)}, unk_token="t0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=word_level)


class Sampler:
    """The engine behind the old one-call signature, to keep these tests short."""

    def __init__(self, engine: EmbeddedEngine):
        self.engine = engine

    def sample(self, prompt: RenderedInput, options: SamplingOptions, num_samples: int = 1,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0) -> SampleOutput:
        return self.engine.sample(SamplingRequest(
            prompt=prompt, options=options, num_samples=num_samples,
            logprobs=LogprobOptions(prompt_logprobs=include_prompt_logprobs, topk_prompt_logprobs=topk_prompt_logprobs)))


@pytest.fixture(scope="module")
def sampler(tokenizer):
    engine_model = random_qwen3()
    _, slot = apply_lora_wrappers(engine_model, family_for("qwen3"))
    engine = EmbeddedEngine(lambda: EngineModel(engine_model, slot, tokenizer))
    yield Sampler(engine)
    engine.close()


def full_forward_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain forward without a cache, in fp32."""
    with torch.no_grad():
        logits_TV = model(input_ids=torch.tensor([token_ids])).logits[0]
    return logits_TV.float().log_softmax(dim=-1)


def test_greedy_output_equals_hf_generate_without_sampling(model, sampler):
    out = sampler.sample(TEXT_PROMPT, SamplingOptions(max_tokens=12, temperature=0.0))
    generated = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out.sequences[0].tokens == generated[0, len(PROMPT) :].tolist()
    assert out.sequences[0].stop_reason == "length"


def test_sampled_token_logprobs_equal_a_full_forward_log_softmax(model, sampler):
    options = SamplingOptions(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=3)
    for sequence in sampler.sample(TEXT_PROMPT, options, num_samples=3).sequences:
        logprobs_TV = full_forward_logprobs(model, PROMPT + sequence.tokens)
        positions = torch.arange(len(PROMPT) - 1, len(PROMPT) - 1 + len(sequence.tokens))
        expected = logprobs_TV[positions, torch.tensor(sequence.tokens)]
        assert torch.allclose(torch.tensor(sequence.logprobs), expected, atol=1e-5, rtol=0)


def test_prompt_logprobs_equal_a_plain_forward_with_none_at_position_zero(model, sampler):
    # compute_logprobs arrives as this exact request.
    out = sampler.sample(TEXT_PROMPT, SamplingOptions(max_tokens=1), include_prompt_logprobs=True)
    logprobs_TV = full_forward_logprobs(model, PROMPT)
    expected = logprobs_TV[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(PROMPT)
    assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), expected, atol=1e-5, rtol=0)
    assert out.topk_prompt_logprobs is None
    assert len(out.sequences) == 1 and len(out.sequences[0].tokens) == 1


def test_topk_prompt_logprobs_are_sorted_and_hold_the_actual_token_when_in_the_top_k(model, sampler):
    k = 40
    out = sampler.sample(TEXT_PROMPT, SamplingOptions(max_tokens=1), topk_prompt_logprobs=k)
    assert out.prompt_logprobs is None
    assert out.topk_prompt_logprobs[0] is None
    logprobs_TV = full_forward_logprobs(model, PROMPT)
    num_found = 0
    for position, alternatives in enumerate(out.topk_prompt_logprobs[1:], start=1):
        values = [logprob for _, logprob in alternatives]
        assert len(alternatives) == k and values == sorted(values, reverse=True)
        actual = logprobs_TV[position - 1, PROMPT[position]].item()
        if actual >= values[-1]:
            num_found += 1
            assert dict(alternatives)[PROMPT[position]] == pytest.approx(actual, abs=1e-5)
    assert num_found > 0


def test_a_fixed_seed_repeats_exactly_and_a_different_seed_differs(sampler):
    def sample(seed):
        options = SamplingOptions(max_tokens=16, seed=seed)
        return [s.tokens for s in sampler.sample(TEXT_PROMPT, options, num_samples=2).sequences]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_rows_of_one_request_differ_at_temperature_one(sampler):
    out = sampler.sample(TEXT_PROMPT, SamplingOptions(max_tokens=16, seed=0), num_samples=4)
    assert len({tuple(s.tokens) for s in out.sequences}) == 4


def test_top_k_of_one_or_a_tiny_top_p_equals_greedy_whatever_the_seed(sampler):
    greedy = sampler.sample(TEXT_PROMPT, SamplingOptions(max_tokens=12, temperature=0.0))
    narrow = (SamplingOptions(max_tokens=12, top_k=1, seed=1), SamplingOptions(max_tokens=12, top_p=1e-6))
    for options in narrow:
        out = sampler.sample(TEXT_PROMPT, options, num_samples=3)
        assert all(s.tokens == greedy.sequences[0].tokens for s in out.sequences)


def test_a_stop_token_ends_each_row_where_it_first_appears_and_is_the_last_token(sampler):
    free = sampler.sample(TEXT_PROMPT, SamplingOptions(max_tokens=20, seed=5), num_samples=4)
    stop_token = free.sequences[0].tokens[3]
    options = SamplingOptions(max_tokens=20, seed=5, stop_token_ids=(stop_token,))
    stopped = sampler.sample(TEXT_PROMPT, options, num_samples=4)
    # A row's draws do not depend on when the other rows stop: each row is a prefix of its free run.
    for free_row, row in zip(free.sequences, stopped.sequences):
        if stop_token in free_row.tokens:
            assert row.tokens == free_row.tokens[: free_row.tokens.index(stop_token) + 1]
            assert row.stop_reason == "stop" and row.tokens[-1] == stop_token
        else:
            assert row.tokens == free_row.tokens and row.stop_reason == "length"
        assert row.logprobs == pytest.approx(free_row.logprobs[: len(row.tokens)], abs=1e-5)


def test_a_stop_string_ends_the_sequence_right_after_the_token_that_completes_it(sampler, tokenizer):
    free = sampler.sample(TEXT_PROMPT, SamplingOptions(max_tokens=20, seed=11)).sequences[0]
    stop = tokenizer.decode(free.tokens[4:6])  # spans two tokens
    end = next(i for i in range(1, len(free.tokens) + 1) if stop in tokenizer.decode(free.tokens[:i]))
    options = SamplingOptions(max_tokens=20, seed=11, stop_strings=(stop,))
    row = sampler.sample(TEXT_PROMPT, options).sequences[0]
    assert row.stop_reason == "stop"
    assert row.tokens == free.tokens[:end]
    assert stop in tokenizer.decode(row.tokens) and stop not in tokenizer.decode(row.tokens[:-1])


def test_max_tokens_gives_length_with_exactly_max_tokens_tokens(sampler):
    out = sampler.sample(TEXT_PROMPT, SamplingOptions(max_tokens=7, seed=2), num_samples=2)
    for sequence in out.sequences:
        assert sequence.stop_reason == "length"
        assert len(sequence.tokens) == len(sequence.logprobs) == 7


def test_num_samples_returns_that_many_sequences(sampler):
    out = sampler.sample(TEXT_PROMPT, SamplingOptions(max_tokens=3, seed=4), num_samples=5)
    assert len(out.sequences) == 5


def test_sampled_top_k_target_and_greedy_alt_token_logprobs_come_from_the_full_forward(model, sampler):
    targets = PromptTargets(positions=np.array([1, 1, 4, 7]), token_ids=np.array([3, 299, 17, 17]))
    out = sampler.engine.sample(SamplingRequest(
        prompt=TEXT_PROMPT, options=SamplingOptions(max_tokens=6, temperature=0.0), num_samples=2,
        logprobs=LogprobOptions(topk_sample_logprobs=5, target_prompt_logprobs=targets, prompt_alt_tokens_k=3)))
    logprobs_TV = full_forward_logprobs(model, PROMPT + out.sequences[0].tokens)
    for sequence in out.sequences:
        for step, (token, best) in enumerate(zip(sequence.tokens, sequence.topk_logprobs)):
            values, ids = logprobs_TV[len(PROMPT) - 1 + step].topk(5)
            assert [t for t, _ in best] == ids.tolist() and best[0][0] == token  # greedy: the best one
            assert [v for _, v in best] == pytest.approx(values.tolist(), abs=1e-5)
    expected = logprobs_TV[torch.from_numpy(targets.positions) - 1, torch.from_numpy(targets.token_ids)]
    np.testing.assert_allclose(out.target_prompt_logprobs, expected.numpy(), atol=1e-5)
    best_PV = logprobs_TV[:len(PROMPT) - 1].max(dim=-1)
    assert out.prompt_alt_tokens.tokens.tolist() == [[t] * 3 for t in best_PV.indices.tolist()]
    np.testing.assert_allclose(out.prompt_alt_tokens.logprobs, best_PV.values[:, None].expand(-1, 3), atol=1e-5)
    assert out.prompt_logprobs is None and out.topk_prompt_logprobs is None


def test_alt_tokens_are_seeded_draws_at_the_temperature_and_leave_the_samples_unchanged(model, sampler):
    def sample(**logprobs):
        return sampler.engine.sample(SamplingRequest(
            prompt=TEXT_PROMPT, options=SamplingOptions(max_tokens=5, temperature=0.1, seed=9), num_samples=2,
            logprobs=LogprobOptions(**logprobs)))

    plain, drawn, again = sample(), sample(prompt_alt_tokens_k=2000), sample(prompt_alt_tokens_k=2000)
    assert [s.tokens for s in drawn.sequences] == [s.tokens for s in plain.sequences]
    np.testing.assert_array_equal(drawn.prompt_alt_tokens.tokens, again.prompt_alt_tokens.tokens)
    logprobs_PV = full_forward_logprobs(model, PROMPT)[:len(PROMPT) - 1]
    tokens = torch.from_numpy(drawn.prompt_alt_tokens.tokens)
    np.testing.assert_allclose(drawn.prompt_alt_tokens.logprobs, logprobs_PV.gather(-1, tokens), atol=1e-5)
    # Each position's draws follow softmax(logits / 0.1): the frequency of each token drawn at least
    # 100 times is its probability, within 5 standard errors.
    probs_PV = (logprobs_PV / 0.1).softmax(dim=-1)
    counts_PV = torch.zeros_like(probs_PV).scatter_add_(-1, tokens, torch.ones_like(tokens, dtype=torch.float))
    frequent = counts_PV >= 100
    error = (counts_PV / 2000 - probs_PV).abs()[frequent]
    assert frequent.any() and (error < 5 * (probs_PV * (1 - probs_PV) / 2000).sqrt()[frequent]).all()
