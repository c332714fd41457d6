"""The training renderer: image pads spliced in, rope positions, and loss inputs checked against the
rendered length."""

import pytest
import torch

from server.errors import InvalidRequest, PayloadTooLarge
from server.rendering.chunks import RenderContext, position_ids, render_model_input
from server.rendering.training import render_training_data, render_training_datum
from server.wire.model_input import EncodedTextChunk, ImageAssetPointerChunk, ImageChunk, ModelInput
from server.wire.training import Datum

from support.vision import context_for, encode, noise_image

VOCAB = 100
CONTEXT = RenderContext(vocab_size=VOCAB, max_length=64, vision=None, images=None)
CE, POLICY = ("weights",), ("logprobs", "advantages")


def _datum(inputs: dict[str, torch.Tensor], tokens=(1, 2, 3, 4, 5, 6)) -> Datum:
    return Datum(model_input=ModelInput(chunks=[EncodedTextChunk(tokens=list(tokens))]), loss_fn_inputs=inputs)


def _render(datum: Datum, required=CE, context: RenderContext = CONTEXT):
    return render_training_datum(datum, 1, context, required)


def _image_datum(base, tokens_before, image_bytes, tokens_after, expected_tokens=None, **inputs) -> Datum:
    vision_start = base.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    vision_end = base.tokenizer.convert_tokens_to_ids("<|vision_end|>")
    chunks = [EncodedTextChunk(tokens=tokens_before + [vision_start]),
              ImageChunk(data=image_bytes, format="png", expected_tokens=expected_tokens),
              EncodedTextChunk(tokens=[vision_end] + tokens_after)]
    return Datum(model_input=ModelInput(chunks=chunks), loss_fn_inputs=inputs)


def test_several_text_chunks_render_like_one():
    split = Datum(model_input=ModelInput(chunks=[EncodedTextChunk(tokens=[1, 2]), EncodedTextChunk(tokens=[3]),
                                                 EncodedTextChunk(tokens=[4, 5])]),
                  loss_fn_inputs={"target_tokens": torch.arange(5)})
    example = _render(split)
    assert example.input_ids == [1, 2, 3, 4, 5] and example.images == [] and example.position_ids is None


def test_an_image_chunk_becomes_exactly_its_token_count_of_pads_between_the_clients_vision_tokens(vision_base):
    context = context_for(vision_base)
    image = encode(noise_image(200, 120))
    num_tokens = vision_base.vision.processor.num_tokens(120, 200)
    length = 3 + 1 + num_tokens + 1 + 2
    datum = _image_datum(vision_base, [10, 11, 12], image, [13, 14], expected_tokens=num_tokens,
                         target_tokens=torch.zeros(length, dtype=torch.long), weights=torch.zeros(length))
    example = _render(datum, context=context)
    pad = vision_base.vision.image_token_id
    vision_start, vision_end = example.input_ids[3], example.input_ids[4 + num_tokens]
    assert example.input_ids == [10, 11, 12, vision_start] + [pad] * num_tokens + [vision_end, 13, 14]
    assert [image.num_tokens for image in example.images] == [num_tokens]
    assert example.images[0].pixel_values.shape[0] == num_tokens * vision_base.vision.processor.merge_size ** 2
    assert example.position_ids.shape == (3, length)


def test_rope_positions_equal_the_models_own_get_rope_index(vision_base):
    context = context_for(vision_base)
    first, second = encode(noise_image(64, 80, seed=1)), encode(noise_image(200, 120, seed=2))
    vision_start = vision_base.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    vision_end = vision_base.tokenizer.convert_tokens_to_ids("<|vision_end|>")
    chunks = [EncodedTextChunk(tokens=[5, 6, vision_start]), ImageChunk(data=first, format="png"),
              EncodedTextChunk(tokens=[vision_end, 7, vision_start]), ImageChunk(data=second, format="png"),
              EncodedTextChunk(tokens=[vision_end, 8, 9, 10])]
    rendered = render_model_input(ModelInput(chunks=chunks), context, "datum")
    input_ids = torch.tensor([rendered.expanded_token_ids()])
    token_types = (input_ids == vision_base.vision.image_token_id).int()
    grids = torch.tensor([image.grid_thw for image in rendered.images])
    expected, _ = vision_base.model.model.get_rope_index(input_ids, token_types, grids)
    assert torch.equal(position_ids(rendered, vision_base.vision), expected[:, 0])


def test_image_token_counts_are_checked_against_expected_tokens(qwen2_vl):
    context = context_for(qwen2_vl)
    image = encode(noise_image(64, 64))
    datum = _image_datum(qwen2_vl, [1], image, [2], expected_tokens=5, target_tokens=torch.zeros(8, dtype=torch.long))
    with pytest.raises(InvalidRequest, match="datum 1 chunk 1: Expected 5 tokens, got 4 from image"):
        _render(datum, context=context)


def test_loss_inputs_must_cover_the_expanded_length(qwen2_vl):
    context = context_for(qwen2_vl)
    datum = _image_datum(qwen2_vl, [1], encode(noise_image(64, 64)), [2],
                         target_tokens=torch.zeros(5, dtype=torch.long))  # 1 + start + 4 pads + end + 1 = 8
    with pytest.raises(InvalidRequest, match="renders to 8 positions"):
        _render(datum, context=context)


def test_media_placeholders_in_text_and_images_for_a_text_model_are_refused(qwen2_vl, text_base):
    pad = qwen2_vl.vision.image_token_id
    video_pad = qwen2_vl.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    for placeholder in (pad, video_pad):
        with pytest.raises(InvalidRequest, match=f"token id {placeholder} is a media placeholder"):
            _render(_datum({"target_tokens": torch.zeros(3, dtype=torch.long)}, tokens=(1, placeholder, 2)),
                    context=context_for(qwen2_vl))
    with pytest.raises(InvalidRequest, match="this model takes no images"):
        _render(_image_datum(text_base, [1], encode(noise_image(8, 8)), [2]), context=context_for(text_base))
    pointer = Datum(model_input=ModelInput(chunks=[ImageAssetPointerChunk(format="png", location="a.png")]),
                    loss_fn_inputs={})
    with pytest.raises(InvalidRequest, match="accepted in sampling requests only"):
        _render(pointer, context=context_for(qwen2_vl))


def test_corrupt_images_are_refused_with_the_datum_and_chunk_named(qwen2_vl):
    datum = _image_datum(qwen2_vl, [1], b"\x89PNG\r\n\x1a\n garbage", [2])
    with pytest.raises(InvalidRequest, match="datum 1 chunk 1: image data could not be decoded"):
        _render(datum, context=context_for(qwen2_vl))


def test_a_requests_images_prepared_side_by_side_render_as_one_by_one_and_its_first_bad_one_is_named(qwen2_vl):
    images = [encode(noise_image(64, 64, seed=index)) for index in range(5)]
    data = [_image_datum(qwen2_vl, [1], image, [2], target_tokens=torch.zeros(8, dtype=torch.long))
            for image in images + images[:2]]  # a multi-turn batch repeats images
    sequential = [render_training_datum(datum, index, context_for(qwen2_vl), ())
                  for index, datum in enumerate(data)]
    context = context_for(qwen2_vl)
    together = render_training_data(data, context, ())
    for one, other in zip(together, sequential):
        assert one.input_ids == other.input_ids and torch.equal(one.position_ids, other.position_ids)
        assert [torch.equal(a.pixels, b.pixels) for a, b in zip(one.images, other.images)] == [True]
    assert together[5].images[0] is together[0].images[0]  # decoded once, found in the cache
    corrupt = b"\x89PNG\r\n\x1a\n garbage"
    bad = data[:2] + [_image_datum(qwen2_vl, [1], corrupt, [2]), _image_datum(qwen2_vl, [1], corrupt + b"!", [2])]
    with pytest.raises(InvalidRequest, match="datum 2 chunk 1: image data could not be decoded"):
        render_training_data(bad, context, ())


def test_missing_weights_default_to_ones_and_dtypes_are_normalised():
    example = _render(_datum({"target_tokens": torch.arange(2, 8, dtype=torch.int32)}))
    assert example.input_ids == [1, 2, 3, 4, 5, 6]
    assert example.loss_fn_inputs["target_tokens"].dtype == torch.int64
    torch.testing.assert_close(example.loss_fn_inputs["weights"], torch.ones(6))


def test_top_k_targets_keep_their_second_dimension():
    example = _render(_datum({"target_tokens": torch.ones(6, 3, dtype=torch.int64), "weights": torch.ones(6, 3)}))
    assert list(example.loss_fn_inputs["weights"].shape) == [6, 3]


@pytest.mark.parametrize(("inputs", "required", "message"), [
    ({"target_tokens": torch.arange(1, 8), "weights": torch.ones(7)}, CE, "target_tokens has shape"),
    ({"target_tokens": torch.arange(1, 6), "weights": torch.ones(5)}, CE, "target_tokens has shape"),
    ({"target_tokens": torch.tensor([1, 2, 3, 4, 5, VOCAB])}, CE, "target_tokens must be in"),
    ({"target_tokens": torch.tensor([1, 2, -1, 4, 5, 6])}, CE, "target_tokens must be in"),
    ({"target_tokens": torch.arange(1, 7), "weights": torch.ones(7)}, CE, "weights has shape"),
    ({"weights": torch.ones(6)}, CE, "needs target_tokens"),
    ({"target_tokens": torch.arange(1, 7), "logprobs": -torch.ones(6)}, POLICY, "needs advantages"),
    ({"target_tokens": torch.arange(1, 7), "logprobs": -torch.ones(6, 2), "advantages": torch.ones(6)}, POLICY,
     "logprobs has shape"),
])
def test_inconsistent_loss_inputs_are_refused_with_the_datum_named(inputs, required, message):
    with pytest.raises(InvalidRequest, match=f"datum 1: .*{message}"):
        _render(_datum(inputs), required)


def test_bad_model_inputs_are_refused():
    targets = {"target_tokens": torch.arange(1, 3)}
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        _render(_datum(targets, tokens=(1, VOCAB)))
    with pytest.raises(PayloadTooLarge, match="over the limit"):
        render_training_datum(_datum({"target_tokens": torch.arange(6)}), 0,
                              RenderContext(vocab_size=VOCAB, max_length=4, vision=None, images=None), CE)
    with pytest.raises(InvalidRequest, match="empty"):
        _render(Datum(model_input=ModelInput(chunks=[]), loss_fn_inputs=targets))
