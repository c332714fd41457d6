"""VLLMSampler on text prompts: every sampling option, stops, num_samples, prompt logprobs, concurrency."""

import threading
import time
from dataclasses import replace

import pytest
import torch
from hf_reference import full_logprobs, load_model

from server.errors import InvalidRequest, PayloadTooLarge
from server.sampling.types import SamplingOptions
from server.sampling.vllm import VLLMSampler
from server.sampling.vllm_process import VLLMEndpoint

# Tensor shape suffixes: T = sequence positions, V = vocabulary, K = top-k alternatives.

PROMPT = "<|im_start|>user\nWhat color is the square?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def hf_model(qwen2_vl):
    return load_model(qwen2_vl.model_dir)


@pytest.fixture(scope="module")
def prompt(qwen2_vl) -> list[int]:
    return qwen2_vl.encode(PROMPT)


def completion_logprobs_TV(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's distribution at each completion step."""
    logprobs_TV = full_logprobs(hf_model, prompt + tokens)
    return logprobs_TV[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def test_greedy_sampling_is_deterministic_and_takes_the_argmax(qwen2_vl, hf_model, prompt):
    options = SamplingOptions(max_tokens=10, temperature=0.0)
    first = qwen2_vl.sampler.sample(prompt, options).sequences[0]
    second = qwen2_vl.sampler.sample(prompt, options).sequences[0]
    assert first == second
    assert first.stop_reason == "length" and len(first.tokens) == 10
    assert first.tokens == completion_logprobs_TV(hf_model, prompt, first.tokens).argmax(dim=-1).tolist()


def test_temperature_top_k_and_top_p_restrict_sampling_while_logprobs_stay_raw(qwen2_vl, hf_model, prompt):
    options = SamplingOptions(max_tokens=12, temperature=0.7, top_k=5, top_p=0.8, seed=1)
    for sequence in qwen2_vl.sampler.sample(prompt, options, num_samples=3).sequences:
        logprobs_TV = completion_logprobs_TV(hf_model, prompt, sequence.tokens)
        for logprobs_V, token in zip(logprobs_TV, sequence.tokens):
            top_K = logprobs_V.topk(options.top_k)
            assert token in top_K.indices.tolist()
            # top-p over the temperature-scaled top-k: the better tokens hold less than top_p of the mass.
            probs_K = (top_K.values / options.temperature).softmax(dim=-1)
            rank = top_K.indices.tolist().index(token)
            assert float(probs_K[:rank].sum()) < options.top_p + 1e-5
        raw = logprobs_TV.gather(-1, torch.tensor(sequence.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(sequence.logprobs), raw, atol=1e-4, rtol=0)


def test_top_k_of_one_samples_the_greedy_completion(qwen2_vl, prompt):
    greedy = qwen2_vl.sampler.sample(prompt, SamplingOptions(max_tokens=8, temperature=0.0)).sequences[0]
    top1 = qwen2_vl.sampler.sample(prompt, SamplingOptions(max_tokens=8, temperature=1.5, top_k=1, seed=3))
    assert top1.sequences[0].tokens == greedy.tokens


def test_a_seed_reproduces_its_samples_and_other_seeds_differ(qwen2_vl, prompt):
    options = SamplingOptions(max_tokens=8, temperature=1.0, seed=42)
    first = qwen2_vl.sampler.sample(prompt, options, num_samples=2).sequences
    again = qwen2_vl.sampler.sample(prompt, options, num_samples=2).sequences
    other = qwen2_vl.sampler.sample(prompt, replace(options, seed=43), num_samples=2).sequences
    assert first == again
    assert first[0].tokens != first[1].tokens
    assert [s.tokens for s in first] != [s.tokens for s in other]


def test_num_samples_above_max_num_seqs_is_split_without_changing_the_samples(qwen2_vl, prompt):
    assert qwen2_vl.server.config.max_num_seqs == 4
    options = SamplingOptions(max_tokens=5, temperature=1.0, seed=7)
    many = qwen2_vl.sampler.sample(prompt, options, num_samples=6, include_prompt_logprobs=True)
    assert len(many.sequences) == 6 and len(many.prompt_logprobs) == len(prompt)
    # vLLM samples child i of a request with seed + i.
    for index, sequence in enumerate(many.sequences):
        single = qwen2_vl.sampler.sample(prompt, replace(options, seed=options.seed + index)).sequences[0]
        assert sequence == single


def test_a_stop_token_ends_the_completion_and_stays_as_its_last_token(qwen2_vl, prompt):
    options = SamplingOptions(max_tokens=16, temperature=1.0, seed=11)
    free = qwen2_vl.sampler.sample(prompt, options).sequences[0]
    stop_at = next(i for i in range(2, 16) if free.tokens[i] not in free.tokens[:i])
    stopped = qwen2_vl.sampler.sample(prompt, replace(options, stop_token_ids=(free.tokens[stop_at],)))
    assert stopped.sequences[0].tokens == free.tokens[: stop_at + 1]
    assert stopped.sequences[0].logprobs == pytest.approx(free.logprobs[: stop_at + 1], abs=1e-6)
    assert stopped.sequences[0].stop_reason == "stop"


def test_a_stop_string_ends_the_completion_right_after_the_token_that_completes_it(qwen2_vl, prompt):
    options = SamplingOptions(max_tokens=16, temperature=1.0, top_k=50, seed=11)
    free = qwen2_vl.sampler.sample(prompt, options).sequences[0]
    texts = [qwen2_vl.tokenizer.decode(free.tokens[: i + 1], skip_special_tokens=False) for i in range(16)]
    # A stop string that straddles two tokens: the last character so far plus the next token's first.
    completes_at, stop = next(
        (i, texts[i - 1][-1] + texts[i][len(texts[i - 1])])
        for i in range(3, 16)
        if texts[i - 1] and texts[i].startswith(texts[i - 1]) and len(texts[i]) > len(texts[i - 1])
        and "\ufffd" not in texts[i - 1][-1] + texts[i][len(texts[i - 1])]
        and texts[i - 1][-1] + texts[i][len(texts[i - 1])] not in texts[i - 1])
    stopped = qwen2_vl.sampler.sample(prompt, replace(options, stop_strings=(stop,))).sequences[0]
    assert stopped.tokens == free.tokens[: completes_at + 1]
    assert stopped.stop_reason == "stop"


def test_eos_stops_a_completion_only_when_the_caller_lists_it(qwen2_vl, hf_model):
    # After <|im_end|> the tiny model's most likely token is <|im_end|>, its generation_config EOS.
    prompt = qwen2_vl.encode("<|im_start|>user\nHi<|im_end|>")
    im_end = qwen2_vl.token_id("<|im_end|>")
    assert int(full_logprobs(hf_model, prompt)[-1].argmax()) == im_end
    with_eos = qwen2_vl.sampler.sample(prompt, SamplingOptions(max_tokens=6, temperature=0.0, stop_token_ids=(im_end,)))
    assert with_eos.sequences[0].tokens == [im_end] and with_eos.sequences[0].stop_reason == "stop"
    # stop=[] in Tinker: no stop token at all, so vLLM's own EOS rule must not apply either.
    without = qwen2_vl.sampler.sample(prompt, SamplingOptions(max_tokens=6, temperature=0.0)).sequences[0]
    assert without.tokens[0] == im_end and len(without.tokens) == 6 and without.stop_reason == "length"


def test_prompt_logprobs_and_their_top_k_equal_hf_with_none_at_position_zero(qwen2_vl, hf_model, prompt):
    k = 4
    out = qwen2_vl.sampler.sample(prompt, SamplingOptions(max_tokens=1), include_prompt_logprobs=True,
                                  topk_prompt_logprobs=k)
    assert len(out.prompt_logprobs) == len(out.topk_prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None and out.topk_prompt_logprobs[0] is None
    logprobs_TV = full_logprobs(hf_model, prompt)[:-1]
    expected = logprobs_TV.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), expected, atol=1e-4, rtol=0)
    top_TK = logprobs_TV.topk(k, dim=-1)
    for position, alternatives in enumerate(out.topk_prompt_logprobs[1:]):
        assert [token for token, _ in alternatives] == top_TK.indices[position].tolist()
        assert [logprob for _, logprob in alternatives] == pytest.approx(top_TK.values[position].tolist(), abs=1e-4)


def test_top_k_prompt_logprobs_alone_leave_the_prompt_logprobs_out(qwen2_vl, prompt):
    out = qwen2_vl.sampler.sample(prompt, SamplingOptions(max_tokens=1), topk_prompt_logprobs=2)
    assert out.prompt_logprobs is None
    assert all(len(alternatives) == 2 for alternatives in out.topk_prompt_logprobs[1:])
    plain = qwen2_vl.sampler.sample(prompt, SamplingOptions(max_tokens=1))
    assert plain.prompt_logprobs is None and plain.topk_prompt_logprobs is None


def test_concurrent_requests_are_decoded_together_not_one_after_another(qwen2_vl, prompt):
    options = SamplingOptions(max_tokens=300, temperature=1.0, seed=1)
    started = time.monotonic()
    qwen2_vl.sampler.sample(prompt, options)
    single = time.monotonic() - started
    threads = [threading.Thread(target=qwen2_vl.sampler.sample, args=(prompt, options)) for _ in range(4)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # One after another would take four times one; the margin absorbs a loaded 2-core box.
    assert time.monotonic() - started < 3 * single, "four requests took about four times one"


def test_a_short_request_sent_during_a_long_one_finishes_first(qwen2_vl, prompt):
    # On this 2-core box vLLM's engine core sometimes takes a second or two to pick up a request
    # that arrives mid-generation, so the long one is long (1000 tokens, several seconds).
    finished: dict[str, float] = {}

    def sample(name: str, max_tokens: int) -> None:
        qwen2_vl.sampler.sample(prompt, SamplingOptions(max_tokens=max_tokens, temperature=1.0, seed=1))
        finished[name] = time.monotonic()

    long = threading.Thread(target=sample, args=("long", qwen2_vl.server.config.max_model_len - len(prompt)))
    long.start()
    time.sleep(0.5)  # the long request is decoding by now
    sample("short", 4)
    long.join()
    assert finished["short"] < finished["long"], "the short request waited for the long one"


def test_concurrent_greedy_requests_give_the_same_completions_as_sequential_ones(qwen2_vl, prompt):
    prompts = [prompt[:n] for n in range(6, len(prompt) + 1)]
    options = SamplingOptions(max_tokens=8, temperature=0.0)
    sequential = [qwen2_vl.sampler.sample(p, options).sequences[0] for p in prompts]
    results: list = [None] * len(prompts)

    def sample(index: int) -> None:
        results[index] = qwen2_vl.sampler.sample(prompts[index], options).sequences[0]

    threads = [threading.Thread(target=sample, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for got, expected in zip(results, sequential):
        assert got.tokens == expected.tokens
        assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)


def test_a_running_vllm_is_reached_by_its_url(qwen2_vl, prompt):
    options = SamplingOptions(max_tokens=6, temperature=0.0)
    endpoint = VLLMEndpoint(qwen2_vl.server.url, qwen2_vl.server.config)
    endpoint.wait_until_ready(timeout_s=10)
    remote = VLLMSampler(endpoint)
    try:
        assert remote.sample(prompt, options) == qwen2_vl.sampler.sample(prompt, options)
    finally:
        remote.close()


def test_a_request_over_the_context_length_is_refused_not_cut_short(qwen2_vl, prompt):
    max_tokens = qwen2_vl.server.config.max_model_len - len(prompt)
    assert len(qwen2_vl.sampler.sample(prompt, SamplingOptions(max_tokens=max_tokens)).sequences[0].tokens) == max_tokens
    with pytest.raises(PayloadTooLarge, match="context length of 1024"):
        qwen2_vl.sampler.sample(prompt, SamplingOptions(max_tokens=max_tokens + 1))


def test_a_request_vllm_refuses_fails_as_an_invalid_request_with_vllms_reason(qwen2_vl):
    with pytest.raises(InvalidRequest, match="vLLM refused the request: Token id 10000 is out of vocabulary"):
        qwen2_vl.sampler.sample([1, 2, 10_000], SamplingOptions(max_tokens=2))
