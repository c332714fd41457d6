"""The embedded engine under concurrency: requests of several adapters, prompts (with images) and
options share its batch, join it while it decodes and leave it when they stop; each gets exactly the
samples and logprobs it gets alone, equal to a full forward with its own adapter. Media placeholders
are never sampled, whatever the model prefers. The tiny Qwen2-VL, and the tiny Qwen3.5 for a batch whose
linear-attention rows carry a recurrent state; references run on a second copy.

Shapes: T = positions, V = vocabulary.
"""

import threading

import pytest
import torch

from server.config import ImageConfig
from server.errors import EngineUnavailable
from server.lora.layers import LoraAdapter, LoraLinear, apply_lora_wrappers, use_adapter
from server.rendering.chunks import RenderedInput, render_model_input
from server.sampling.embedded import EmbeddedEngine
from server.sampling.embedded_batch import EngineModel, _Batch
from server.sampling.embedded_requests import _Active, _Part, _Waiting
from server.sampling.types import AdapterRef, LogprobOptions, SamplingOptions, SamplingRequest
from server.wire.model_input import EncodedTextChunk, ImageChunk, ModelInput

from support.engines import adapter, logged_engine
from support.vision import context_for, encode, load, noise_image

BASE_MODEL = "builtin:tiny-qwen2-vl"
HYBRID_MODEL = "builtin:tiny-qwen3.5"


@pytest.fixture(scope="module")
def reference(models_dir):
    """A second copy of the model with its own LoRA wrappers, for full forwards."""
    base = load(BASE_MODEL, models_dir)
    targets, slot = apply_lora_wrappers(base.model, base.family)
    return base, targets, slot


def engine_for(models_dir, row_ranks: list | None = None, **kwargs) -> tuple[EmbeddedEngine, list]:
    """An engine and the list its forwards log (rows, cache width) to; `row_ranks`, when given, gets
    each forward's LoRA rank per row (0: the base model), which tells requests of different adapters apart."""
    forwards = []

    def log(engine_model, call):
        mask = call["attention_mask"]
        if mask is None:  # a prefill without padding: its rows, and its cached and new positions
            rows, run = call["input_ids"].shape
            forwards.append((rows, call["past_key_values"].get_seq_length() + run))
        elif mask.dim() == 4:  # a decode step over a bucket of the static cache: the rows and columns in use
            cache = engine.batch.cache
            forwards.append((cache.rows, cache.used_width + 1))
        else:
            forwards.append(tuple(mask.shape))
        if row_ranks is not None:
            row_ranks.append(adapter_rank_per_row(engine_model.slot.layers[0], call["input_ids"].shape[0]))

    engine = logged_engine(BASE_MODEL, models_dir, log, **kwargs)
    return engine, forwards


def adapter_rank_per_row(layer: LoraLinear, num_rows: int) -> list[int]:
    """The rank of the adapter that each row of the running forward uses at `layer` (0: none)."""
    if layer.row_scale_BJ is None:
        return [0] * num_rows
    return (layer.row_scale_BJ != 0).sum(dim=1).tolist()


@pytest.fixture(scope="module")
def engine(models_dir):
    engine, _ = engine_for(models_dir)
    yield engine
    engine.close()


def prompts(base) -> list[RenderedInput]:
    context = context_for(base, ImageConfig())
    ids = base.tokenizer.encode
    start, end = ids("<|vision_start|>"), ids("<|vision_end|>")
    text = [ids("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"), ids("One two three four"),
            ids("A much longer prompt about shapes and colours, with a few more words in it")]
    rendered = [render_model_input(ModelInput(chunks=[EncodedTextChunk(tokens=t)]), context, "prompt") for t in text]
    for seed, (width, height) in enumerate([(90, 60), (64, 64)]):
        chunks = [EncodedTextChunk(tokens=ids("Look:") + start), ImageChunk(data=encode(noise_image(width, height, seed)),
                                                                            format="png"),
                  EncodedTextChunk(tokens=end + ids("What is it?"))]
        rendered.append(render_model_input(ModelInput(chunks=chunks), context, "prompt"))
    return rendered


def reference_logprobs(reference, prompt: RenderedInput, tokens: list[int], lora: LoraAdapter | None) -> torch.Tensor:
    """Masked log p of every token of prompt + tokens after the first, from one full forward."""
    base, _, slot = reference
    full = torch.tensor([prompt.expanded_token_ids() + tokens])
    inputs = {"input_ids": full}
    if prompt.images:
        inputs.update(pixel_values=torch.cat([image.pixel_values for image in prompt.images]),
                      image_grid_thw=torch.tensor([image.grid_thw for image in prompt.images]),
                      mm_token_type_ids=(full == base.vision.image_token_id).int())
    refused = torch.tensor(sorted(base.vision.reserved_token_ids))
    with torch.no_grad(), use_adapter(slot, lora):
        logits_TV = base.model(**inputs).logits[0].float()
    logprobs_TV = logits_TV.index_fill(-1, refused, float("-inf")).log_softmax(-1)
    targets = full[0, 1:]
    return logprobs_TV[:-1].gather(-1, targets[:, None])[:, 0].masked_fill(torch.isin(targets, refused), 0.0)


def assert_same_samples(output, expected) -> None:
    """Same tokens and stop reasons; logprobs equal up to the rounding of other batch shapes."""
    assert [(s.tokens, s.stop_reason) for s in output.sequences] == [(s.tokens, s.stop_reason) for s in expected.sequences]
    for got, want in zip(output.sequences, expected.sequences):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


def run_concurrently(engine: EmbeddedEngine, requests: list[SamplingRequest]) -> list:
    results: list = [None] * len(requests)

    def run(index: int) -> None:
        results[index] = engine.sample(requests[index])

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.fixture(scope="module")
def hybrid(models_dir):
    """Qwen3.5's hybrid layers (linear attention between full attention): the engine and a reference copy."""
    base = load(HYBRID_MODEL, models_dir)
    targets, slot = apply_lora_wrappers(base.model, base.family)
    engine = logged_engine(HYBRID_MODEL, models_dir, lambda engine_model, call: None)
    yield engine, (base, targets, slot)
    engine.close()


def test_concurrent_requests_of_several_adapters_each_get_their_own_samples_and_logprobs(engine, reference):
    check_concurrent_requests_of_several_adapters(engine, reference)


def test_a_prompt_prefilled_alone_without_a_mask_gets_the_logits_it_gets_left_padded_beside_a_longer_one(reference):
    base, _, slot = reference
    batch = _Batch(EngineModel(base.model, slot, base.tokenizer, base.vision), max_batch_tokens=4096)

    def prefill(*rendered: RenderedInput):
        parts = [_Part(_Active(_Waiting(SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=1)), None),
                               batch.device), 0, 1) for prompt in rendered]
        return batch._prefill_forward([batch._plan(part) for part in parts])

    short, long = prompts(base)[1:3]
    _, alone_MP, _, alone_MV = prefill(short)
    _, padded_MP, _, padded_MV = prefill(short, long)
    assert bool(alone_MP.all()) and not bool(padded_MP[0].all())  # no mask at all, then a mask over padding
    torch.testing.assert_close(alone_MV[0], padded_MV[0], atol=1e-5, rtol=0)


def test_on_a_hybrid_model_rows_that_join_and_leave_keep_their_own_recurrent_state(hybrid):
    check_concurrent_requests_of_several_adapters(*hybrid)


def check_concurrent_requests_of_several_adapters(engine, reference) -> None:
    base, targets, _ = reference
    adapters = [adapter(targets, 1, 4), adapter(targets, 2, 8, train_unembed=False), None]
    options = [SamplingOptions(max_tokens=8, temperature=0.0), SamplingOptions(max_tokens=12, seed=3),
               SamplingOptions(max_tokens=5, seed=4, top_k=20, top_p=0.9)]
    requests = []
    for index, prompt in enumerate(prompts(base) * 3):
        lora = adapters[index % 3]
        ref = None if lora is None else AdapterRef(name=f"adapter-{index % 3}", directory=None, weights=lora)
        requests.append(SamplingRequest(prompt=prompt, options=options[index % len(options)], adapter=ref,
                                        num_samples=1 + index % 3,
                                        logprobs=LogprobOptions(prompt_logprobs=index % 4 == 0)))
    together = run_concurrently(engine, requests)
    for request, output in zip(requests, together):
        assert_same_samples(output, engine.sample(request))
        lora = None if request.adapter is None else request.adapter.weights
        length = request.prompt.num_positions
        for sequence in output.sequences:
            expected = reference_logprobs(reference, request.prompt, sequence.tokens, lora)
            torch.testing.assert_close(torch.tensor(sequence.logprobs), expected[length - 1:], atol=1e-4, rtol=0)
        if request.logprobs.prompt_logprobs:
            assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == length
            expected = reference_logprobs(reference, request.prompt, [], lora)
            torch.testing.assert_close(torch.tensor(output.prompt_logprobs[1:]), expected, atol=1e-4, rtol=0)


def test_a_short_request_sent_while_a_long_one_decodes_finishes_first(models_dir, reference):
    engine, forwards = engine_for(models_dir)
    prompt = prompts(reference[0])[0]
    long = SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=400, seed=1))
    short = SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=3, seed=2))
    finished = []
    try:
        long_thread = threading.Thread(target=lambda: finished.append(("long", engine.sample(long))))
        long_thread.start()
        while len(forwards) < 3 and long_thread.is_alive():  # the long request is decoding
            threading.Event().wait(0.01)
        finished.append(("short", engine.sample(short)))
        long_thread.join()
        assert [name for name, _ in finished] == ["short", "long"]
        # Joining the batch changed neither request's samples.
        for (_, output), request in zip(finished, [short, long]):
            assert_same_samples(output, engine.sample(request))
    finally:
        engine.close()


def test_requests_beyond_the_token_budget_wait_their_turn(models_dir, reference):
    budget = 96
    engine, forwards = engine_for(models_dir, max_batch_tokens=budget)
    prompt = prompts(reference[0])[1]  # 4 tokens
    requests = [SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=10, seed=seed), num_samples=2)
                for seed in range(6)]
    try:
        together = run_concurrently(engine, requests)
        assert max(rows * width for rows, width in forwards) <= budget
        assert max(rows for rows, _ in forwards) >= 4  # more than one request at a time all the same
        for request, output in zip(requests, together):
            assert_same_samples(output, engine.sample(request))
    finally:
        engine.close()


def test_a_small_request_of_another_tenant_is_not_held_by_a_huge_one_admitted_in_parts(models_dir, reference,
                                                                                      engine):
    base, targets, _ = reference
    budget = 96
    ranks: list[list[int]] = []
    fair, forwards = engine_for(models_dir, row_ranks=ranks, max_batch_tokens=budget)
    prompt = prompts(base)[1]  # 4 tokens: a row of the huge request takes 4 + 24 cache positions, 3 fit
    huge = SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=24, seed=7, top_k=50, top_p=0.95),
                           adapter=AdapterRef(name="huge", directory=None, weights=adapter(targets, 7, 4)),
                           num_samples=12, logprobs=LogprobOptions(prompt_logprobs=True, topk_sample_logprobs=2))
    small = SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=3, seed=8),
                            adapter=AdapterRef(name="small", directory=None, weights=adapter(targets, 8, 8)))
    results = {}
    try:
        huge_thread = threading.Thread(target=lambda: results.update(huge=fair.sample(huge)))
        huge_thread.start()
        while len(forwards) < 3 and huge_thread.is_alive():  # the huge request is decoding
            threading.Event().wait(0.01)
        results["small"] = fair.sample(small)
        huge_thread.join()
    finally:
        fair.close()
    huge_rows = [row_ranks.count(4) for row_ranks in ranks]
    small_forwards = [step for step, row_ranks in enumerate(ranks) if 8 in row_ranks]
    # The huge request never had all its rows in the batch: it joined a few samples at a time, within the budget.
    assert max(huge_rows) == budget // (4 + 24) < huge.num_samples
    assert max(rows * width for rows, width in forwards) <= budget
    # The small one ran beside it and was done while the huge one still had rows to decode.
    assert small_forwards and huge_rows[small_forwards[-1]] > 0  # its prefill runs alone, its decode beside
    assert sum(huge_rows[small_forwards[-1] + 1:]) > 0
    # Admitted in parts and interleaved, every sample is what the huge request gets in one batch.
    in_one_batch = engine.sample(huge)
    assert_same_samples(results["huge"], in_one_batch)
    for got, want in zip(results["huge"].sequences, in_one_batch.sequences):
        assert [[t for t, _ in k] for k in got.topk_logprobs] == [[t for t, _ in k] for k in want.topk_logprobs]
    torch.testing.assert_close(torch.tensor(results["huge"].prompt_logprobs[1:]),
                               torch.tensor(in_one_batch.prompt_logprobs[1:]), atol=1e-5, rtol=0)
    assert_same_samples(results["small"], engine.sample(small))


def test_two_huge_requests_share_the_batch_half_and_half_once_both_wait(models_dir, reference):
    base, targets, _ = reference
    budget = 6 * (4 + 24)  # six rows of 4 prompt + 24 sampled tokens: half is three rows
    ranks: list[list[int]] = []
    fair, _ = engine_for(models_dir, row_ranks=ranks, max_batch_tokens=budget)
    prompt = prompts(base)[1]

    def huge(seed: int, rank: int) -> SamplingRequest:
        return SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=24, seed=seed), num_samples=12,
                               adapter=AdapterRef(name=f"huge-{rank}", directory=None,
                                                  weights=adapter(targets, seed, rank)))
    try:
        first = threading.Thread(target=lambda: fair.sample(huge(1, 4)))
        first.start()
        while len(ranks) < 3 and first.is_alive():  # the first one is decoding, alone: all six rows
            threading.Event().wait(0.01)
        fair.sample(huge(2, 8))
        first.join()
    finally:
        fair.close()
    first_rows = [row_ranks.count(4) for row_ranks in ranks]
    second_rows = [row_ranks.count(8) for row_ranks in ranks]
    assert max(first_rows) == 6  # alone, the first filled the budget
    joined = second_rows.index(next(rows for rows in second_rows if rows))
    last_of_first = max(step for step, rows in enumerate(first_rows) if rows)
    assert joined < last_of_first  # the second got rows long before the first was done
    # From then on, while both had rows to run, each held half the budget, neither more.
    shared = list(zip(first_rows, second_rows))[joined:last_of_first + 1]
    assert max(max(pair) for pair in shared) == 3


def test_a_newcomer_starts_at_once_beside_long_rows_that_fill_the_batch(models_dir, reference, engine):
    base, targets, _ = reference
    budget = 8 * (4 + 24)  # eight rows of 4 prompt + 24 sampled tokens: the long request's eight samples
    ranks: list[list[int]] = []
    short_sent = threading.Event()

    def log(engine_model, call):  # the third forward (the long rows decoding) waits for the short request
        ranks.append(adapter_rank_per_row(engine_model.slot.layers[0], call["input_ids"].shape[0]))
        if len(ranks) == 3:
            assert short_sent.wait(timeout=120)

    fair = logged_engine(BASE_MODEL, models_dir, log, max_batch_tokens=budget)
    prompt = prompts(base)[1]
    long = SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=24, seed=3), num_samples=8,
                           adapter=AdapterRef(name="long", directory=None, weights=adapter(targets, 3, 4)))
    short = SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=3, seed=4),
                            adapter=AdapterRef(name="short", directory=None, weights=adapter(targets, 4, 8)))
    try:
        long_future = fair.submit(long)
        while len(ranks) < 3 and not long_future.done():  # a failed engine ends the wait too
            threading.Event().wait(0.01)
        short_future = fair.submit(short)
        short_sent.set()
        results = {"long": long_future.result(), "short": short_future.result()}
    finally:
        short_sent.set()
        fair.close()
    long_rows = [row_ranks.count(4) for row_ranks in ranks]
    short_steps = [step for step, row_ranks in enumerate(ranks) if 8 in row_ranks]
    assert max(long_rows) == 8  # the whole budget
    # The short request ran beside the long rows, not after them: prefilled at the next step in a row over the
    # budget, then decoded beside all eight, and done long before they stopped.
    assert short_steps == [3, 4, 5] and all(long_rows[step] == 8 for step in short_steps[1:])
    assert short_steps[-1] < max(step for step, rows in enumerate(long_rows) if rows == 8)
    assert_same_samples(results["short"], engine.sample(short))
    assert_same_samples(results["long"], engine.sample(long))


def test_sample_i_of_seed_s_is_sample_0_of_seed_s_plus_i_as_on_vllm(engine, reference):
    prompt = prompts(reference[0])[0]
    together = engine.sample(SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=8, seed=20),
                                             num_samples=3))
    for index, sequence in enumerate(together.sequences):
        alone = engine.sample(SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=8, seed=20 + index)))
        assert (alone.sequences[0].tokens, alone.sequences[0].stop_reason) == (sequence.tokens, sequence.stop_reason)
    assert len({tuple(sequence.tokens) for sequence in together.sequences}) > 1


def test_media_placeholders_are_never_sampled_and_logprobs_are_renormalised(engine, reference):
    base, targets, slot = reference
    refused = sorted(base.vision.reserved_token_ids)
    lora = adapter(targets, 5, 4)
    ref = AdapterRef(name="with-lm-head", directory=None, weights=lora)
    prompt = prompts(base)[3]  # with an image
    requests = [SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=128, temperature=1.0, seed=seed),
                                adapter=ref, num_samples=8) for seed in range(8)]
    outputs = run_concurrently(engine, requests)
    sequences = [sequence for output in outputs for sequence in output.sequences]
    sampled = [token for sequence in sequences for token in sequence.tokens]
    assert len(sampled) == 8 * 8 * 128 and not set(sampled) & set(refused)
    # Without the mask the placeholders would have come up: their mass, summed over the sampled steps.
    expected_placeholders = 0.0
    for sequence in sequences:
        full = torch.tensor([prompt.expanded_token_ids() + sequence.tokens])
        with torch.no_grad(), use_adapter(slot, lora):
            logits_TV = base.model(input_ids=full, pixel_values=torch.cat([i.pixel_values for i in prompt.images]),
                                   image_grid_thw=torch.tensor([i.grid_thw for i in prompt.images]),
                                   mm_token_type_ids=(full == base.vision.image_token_id).int()).logits[0].float()
        steps_TV = logits_TV[prompt.num_positions - 1:-1]
        expected_placeholders += float(steps_TV.softmax(-1)[:, refused].sum())
        # The returned logprobs are the renormalised ones the sampler drew from.
        masked = steps_TV.index_fill(-1, torch.tensor(refused), float("-inf")).log_softmax(-1)
        expected = masked.gather(-1, torch.tensor(sequence.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sequence.logprobs), expected, atol=1e-4, rtol=0)
    assert expected_placeholders > 5, expected_placeholders


def test_a_request_that_fails_fails_alone_and_the_engine_serves_the_next(engine, reference):
    base, targets, _ = reference
    prompt = prompts(base)[0]
    good = SamplingRequest(prompt=prompt, options=SamplingOptions(max_tokens=6, seed=1))
    broken = adapter(targets, 6, 4)
    name = next(iter(broken.lora_A))
    broken.lora_A[name] = torch.zeros(4, 3)  # the wrong shape for its layer
    bad = SamplingRequest(prompt=prompt, options=good.options,
                          adapter=AdapterRef(name="broken", directory=None, weights=broken))
    results = {}

    def run(key, request):
        try:
            results[key] = engine.sample(request)
        except EngineUnavailable as error:
            results[key] = error

    threads = [threading.Thread(target=run, args=(key, request)) for key, request in [("good", good), ("bad", bad)]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert isinstance(results["bad"], EngineUnavailable) and "failed" in str(results["bad"])
    assert_same_samples(results["good"], engine.sample(good))
