"""stable_reinforce and gspo through the real SDK: sequences sampled with record_stability_info train
with provenance spans; every claim the record does not back is a 400, and the run goes on after it."""

import numpy as np
import pytest
import tinker
from tinker import types

from support.live_server import BASE_MODEL
from support.sdk import forward_logprobs, supervised_datum

PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])


@pytest.fixture(scope="module")
def run(service_client):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=31).result()
    return tc, tc.get_tokenizer()


def policy_datum(prompt: list[int], sequence: types.SampledSequence, advantage: float,
                 provenance: bool = True, tokens: list[int] | None = None) -> types.Datum:
    """rl_loop's layout: zeros on the prompt's targets, the advantage on every sampled token (or on `tokens`)."""
    tokens = tokens or sequence.tokens
    num_prompt = len(prompt) - 1
    datum = types.Datum(model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
                        loss_fn_inputs={"target_tokens": [0] * num_prompt + tokens,
                                        "logprobs": [0.0] * num_prompt + sequence.logprobs,
                                        "advantages": [0.0] * num_prompt + [advantage] * len(tokens)})
    if not provenance:
        return datum
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=len(tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, offset=1, length=num_prompt),
                        types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=len(tokens))])


def sample(sampler: tinker.SamplingClient, prompt: list[int], num_samples: int = 2) -> list[types.SampledSequence]:
    return sampler.sample(types.ModelInput.from_ints(prompt), num_samples=num_samples,
                          sampling_params=PARAMS).result().sequences


def test_recorded_sequences_train_with_stable_reinforce_on_the_sampler_logprobs(run):
    tc, tokenizer = run
    prompt = tokenizer.encode("Which shape is big?")
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequences = sample(sampler, prompt)
    assert len({s.sequence_id for s in sequences}) == 2
    data = [policy_datum(prompt, s, a) for s, a in zip(sequences, [1.0, -1.0])]

    out = tc.forward_backward(data, "stable_reinforce", loss_fn_config={"kl_coeff": 0.1}).result()

    num_sampled = sum(len(s.tokens) for s in sequences)
    assert out.metrics["sampled_tokens:sum"] == num_sampled
    assert out.metrics["sampler_logprobs_mismatched:sum"] == 0
    # Sampled from these very weights: ratios are 1 up to the sampler/trainer difference.
    assert out.metrics["importance_ratio:max"] == pytest.approx(1.0, abs=1e-3)
    expected = 0.0
    for datum, output, sequence, advantage in zip(data, out.loss_fn_outputs, sequences, [1.0, -1.0]):
        trainer_logprobs = np.asarray(output["logprobs"].tolist())[-len(sequence.tokens):]
        log_ratio = trainer_logprobs - np.asarray(sequence.logprobs)
        expected += float(np.sum(-np.minimum(np.exp(log_ratio), 2.0) * advantage * trainer_logprobs
                                 + 0.05 * log_ratio ** 2))
        assert len(output["logprobs"].tolist()) == datum.model_input.length
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    # The next step trains on the same (now off-policy) sequences, which the record still backs.
    again = tc.forward_backward(data, "stable_reinforce").result()
    assert again.metrics["importance_ratio:max"] > 1.0 + 1e-3


def test_claims_the_record_does_not_back_are_400s_and_the_run_goes_on(server, service_client, run):
    tc, tokenizer = run
    prompt = tokenizer.encode("The blue circle is on the left")
    recorded = sample(tc.save_weights_and_get_sampling_client(record_stability_info=True).result(), prompt, 1)[0]
    unrecorded = sample(tc.save_weights_and_get_sampling_client().result(), prompt, 1)[0]

    with pytest.raises(tinker.BadRequestError, match=f"sequence {unrecorded.sequence_id} is unknown or expired"):
        tc.forward_backward([policy_datum(prompt, unrecorded, 1.0)], "stable_reinforce").result()
    with pytest.raises(tinker.BadRequestError, match="needs provenance on every datum"):
        tc.forward_backward([policy_datum(prompt, recorded, 1.0, provenance=False)], "stable_reinforce").result()
    forged = [*recorded.tokens[:-1], (recorded.tokens[-1] + 1) % 500]
    with pytest.raises(tinker.BadRequestError, match="do not match the sampled tokens"):
        tc.forward_backward([policy_datum(prompt, recorded, 1.0, tokens=forged)], "stable_reinforce").result()

    # Another session of the same tenant, and another tenant, cannot train on this session's samples.
    with server.service_client() as other_session:
        other = other_session.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=32).result()
        with pytest.raises(tinker.BadRequestError, match="was sampled in session .* not in this run's session"):
            other.forward_backward([policy_datum(prompt, recorded, 1.0)], "stable_reinforce").result()
    with server.service_client(api_key=server.create_key("another-tenant")) as stranger:
        theirs = stranger.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=33).result()
        with pytest.raises(tinker.BadRequestError, match="unknown or expired"):
            theirs.forward_backward([policy_datum(prompt, recorded, 1.0)], "stable_reinforce").result()

    before = forward_logprobs(tc, [supervised_datum(tokenizer, "The blue circle")])
    tc.forward_backward([policy_datum(prompt, recorded, 1.0)], "stable_reinforce").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = forward_logprobs(tc, [supervised_datum(tokenizer, "The blue circle")])
    assert np.abs(after[0] - before[0]).max() > 1e-5


def test_gspo_without_a_mask_trains_and_counts_the_missing_mask(run):
    tc, tokenizer = run
    prompt = tokenizer.encode("One two three")
    sequences = sample(tc.save_weights_and_get_sampling_client().result(), prompt)
    data = [policy_datum(prompt, s, a, provenance=False) for s, a in zip(sequences, [0.5, -0.5])]
    masked = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        **d.loss_fn_inputs, "sequence_ratio_mask": (d.loss_fn_inputs["advantages"].to_numpy() != 0).astype(np.float32)})
        for d in data]

    without = tc.forward(data, "gspo").result()
    with_mask = tc.forward(masked, "gspo").result()

    assert without.metrics["sequence_ratio_mask_missing:sum"] == 2
    assert with_mask.metrics["sequence_ratio_mask_missing:sum"] == 0
    assert without.metrics["loss:sum"] == pytest.approx(with_mask.metrics["loss:sum"], rel=1e-6)
    assert with_mask.metrics["sequence_ratio:max"] == pytest.approx(1.0, abs=1e-3)
