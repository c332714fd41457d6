"""Provenance spans against recorded samples: a 2-turn, 2-image episode built by the cookbook's own
`trajectory_to_data`, sent through the SDK's protobuf, and every way its claims can be wrong."""

import dataclasses

import numpy as np
import pytest
import tinker
from tinker import types as sdk
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker_cookbook.completers import TokensWithLogprobs
from tinker_cookbook.rl.data_processing import trajectory_to_data
from tinker_cookbook.rl.types import Trajectory, Transition

from server.errors import InvalidRequest
from server.rendering.provenance import RECORDED_LOGPROBS, SAMPLED_MASK, attach_recorded_samples, named_sequence_ids
from server.rendering.provenance import position_keys
from server.rendering.sampling import VLLMRenderer
from server.rendering.training import render_training_datum
from server.store.sampled_sequences import SampledSequenceRecord
from server.wire.model_input import ModelInput
from server.wire.proto import decode_forward_backward_request

from support.vision import context_for, encode, noise_image


@dataclasses.dataclass
class Episode:
    datum: sdk.Datum
    records: dict[str, SampledSequenceRecord]
    actions: list[list[int]]
    logprobs: list[list[float]]


def build_episode(base, second_image: bytes | None = None) -> Episode:
    """Turn 1 sees image A; turn 2's observation adds image B. Sampled as sequences s1 and s2."""
    tokenizer = base.tokenizer
    context = context_for(base)
    image_a, image_b = encode(noise_image(64, 48, seed=1)), encode(noise_image(40, 72, seed=2))
    num_a = base.vision.processor.num_tokens(48, 64)
    num_b = base.vision.processor.num_tokens(72, 40)

    def text(value: str) -> sdk.EncodedTextChunk:
        return sdk.EncodedTextChunk(tokens=tokenizer.encode(value))

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt_1 = sdk.ModelInput(chunks=[text("<|im_start|>user\n<|vision_start|>"),
                                      sdk.ImageChunk(data=image_a, format="png", expected_tokens=num_a),
                                      text("<|vision_end|>Which way?<|im_end|>\n<|im_start|>assistant\n")])
    actions = [tokenizer.encode("left") + [im_end], tokenizer.encode("right now") + [im_end]]
    logprobs = [[-0.5, -1.25][:len(actions[0]) - 1] + [-0.125], [-2.0] * (len(actions[1]) - 1) + [-0.25]]
    observation = [text("\n<|im_start|>user\n<|vision_start|>"),
                   sdk.ImageChunk(data=image_b, format="png", expected_tokens=num_b),
                   text("<|vision_end|>Wrong.<|im_end|>\n<|im_start|>assistant\n")]
    prompt_2 = sdk.ModelInput(chunks=[*prompt_1.chunks, sdk.EncodedTextChunk(tokens=actions[0]), *observation])

    records = {}
    renderer = VLLMRenderer(context)
    for sequence_id, prompt, action, action_logprobs in zip(["s1", "s2"], [prompt_1, prompt_2], actions, logprobs):
        rendered = renderer.render(ModelInput.model_validate_json(prompt.model_dump_json()))
        records[sequence_id] = SampledSequenceRecord(
            sequence_id=sequence_id, owner="alice", session_id="S", sampling_session_id="S:sample:0", adapter=None,
            prompt_keys=position_keys(rendered.expanded_token_ids(), rendered.images, rendered.image_token_id),
            tokens=np.array(action), logprobs=np.array(action_logprobs, dtype=np.float32))

    if second_image is not None:  # the datum claims another image than the one sampled in turn 2
        prompt_2 = sdk.ModelInput(chunks=[*prompt_1.chunks, sdk.EncodedTextChunk(tokens=actions[0]), observation[0],
                                          sdk.ImageChunk(data=second_image, format="png", expected_tokens=num_b),
                                          observation[2]])
    transitions = [Transition(ob=ob, ac=TokensWithLogprobs(tokens=a, maybe_logprobs=lp, sequence_id=sid), reward=0.0,
                              episode_done=i == 1)
                   for i, (ob, a, lp, sid) in enumerate(zip([prompt_1, prompt_2], actions, logprobs, ["s1", "s2"]))]
    (datum,) = trajectory_to_data(Trajectory(transitions=transitions, final_ob=sdk.ModelInput.empty()), 0.5)
    datum = dataclasses.replace(datum, loss_fn_inputs={k: v for k, v in datum.loss_fn_inputs.items() if k != "mask"})
    return Episode(datum, records, actions, logprobs)


def through_the_wire(datum: sdk.Datum):
    request = sdk.ForwardBackwardRequest(
        forward_backward_input=sdk.ForwardBackwardInput(data=[datum], loss_fn="stable_reinforce"),
        model_id="S:train:0", seq_id=1)
    return decode_forward_backward_request(forward_backward_request_to_proto(request).SerializeToString(), None).data[0]


def check(base, datum: sdk.Datum, records):
    decoded = through_the_wire(datum)
    example = render_training_datum(decoded, 0, context_for(base), ("logprobs", "advantages"))
    assert named_sequence_ids([decoded]) <= set(records)
    attach_recorded_samples(example, decoded, 0, records, base.vision.image_token_id)
    return example


def test_a_cookbook_multi_turn_datum_with_two_images_gets_the_recorded_logprobs_on_its_sampled_targets(qwen2_vl):
    episode = build_episode(qwen2_vl)
    example = check(qwen2_vl, episode.datum, episode.records)

    sampled = example.loss_fn_inputs[SAMPLED_MASK].numpy()
    recorded = example.loss_fn_inputs[RECORDED_LOGPROBS].numpy()
    targets = example.loss_fn_inputs["target_tokens"].numpy()
    advantages = example.loss_fn_inputs["advantages"].numpy()
    np.testing.assert_array_equal(sampled != 0, advantages != 0)  # exactly the two actions
    np.testing.assert_array_equal(targets[sampled != 0], np.concatenate(episode.actions))
    np.testing.assert_array_equal(recorded[sampled != 0], np.concatenate(episode.logprobs).astype(np.float32))
    assert (recorded[sampled == 0] == 0).all()


def test_a_datum_without_spans_is_refused_with_what_to_do():
    datum = through_the_wire(sdk.Datum(model_input=sdk.ModelInput.from_ints([1, 2]),
                                       loss_fn_inputs={"target_tokens": [2, 3]}))
    with pytest.raises(InvalidRequest, match="needs provenance on every datum.*record_stability_info=True"):
        named_sequence_ids([datum])


def replace_spans(datum: sdk.Datum, model_input=None, loss_fn_inputs=None) -> sdk.Datum:
    return dataclasses.replace(datum, model_input_spans=model_input or datum.model_input_spans,
                               loss_fn_input_spans=loss_fn_inputs or datum.loss_fn_input_spans)


def test_every_wrong_claim_is_a_400_that_says_what_differs(qwen2_vl):
    episode = build_episode(qwen2_vl)
    datum, records = episode.datum, episode.records
    spans, targets = datum.model_input_spans, datum.loss_fn_input_spans

    short = [*spans[:-1], dataclasses.replace(spans[-1], length=spans[-1].length - 1)]
    with pytest.raises(InvalidRequest, match="model_input_spans cover .* positions but the model input has"):
        check(qwen2_vl, replace_spans(datum, model_input=short), records)

    past_the_end = [*targets[:-1], dataclasses.replace(targets[-1], offset=1)]
    with pytest.raises(InvalidRequest, match="claims positions .* of the sampled tokens of sequence s2, which has"):
        check(qwen2_vl, replace_spans(datum, loss_fn_inputs=past_the_end), records)

    # The record says another token was sampled than the one the datum trains.
    tokens = records["s2"].tokens.copy()
    tokens[0] += 1
    altered = {**records, "s2": dataclasses.replace(records["s2"], tokens=tokens)}
    with pytest.raises(InvalidRequest, match=rf"do not match the sampled tokens of sequence s2 at offset 0 \(first "
                                             rf"difference 0 positions in: token {tokens[0] - 1} where token "
                                             rf"{tokens[0]} was recorded\)"):
        check(qwen2_vl, datum, altered)

    advantages = datum.loss_fn_inputs["advantages"].to_numpy().copy()
    advantages[0] = 0.5
    with pytest.raises(InvalidRequest, match="only accepts nonzero advantages on sampled tokens; target 0 is in a "
                                             "prompt span of sequence s1"):
        inputs = {**datum.loss_fn_inputs, "advantages": tinker.TensorData.from_numpy(advantages)}
        check(qwen2_vl, dataclasses.replace(datum, loss_fn_inputs=inputs), records)


def test_a_datum_with_another_image_than_the_one_sampled_is_refused(qwen2_vl):
    other = encode(noise_image(40, 72, seed=3))
    episode = build_episode(qwen2_vl, second_image=other)
    with pytest.raises(InvalidRequest, match="model input positions .* do not match the prompt of sequence s2 .*"
                                             "image [0-9a-f]+ where image [0-9a-f]+ was recorded"):
        check(qwen2_vl, episode.datum, episode.records)
