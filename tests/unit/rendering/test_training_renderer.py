"""The training renderer: chunk lists to input ids, and loss inputs checked against the rendered length."""

import pytest
import torch

from server.errors import InvalidRequest, PayloadTooLarge
from server.rendering.training import model_input_token_ids, render_training_datum
from server.wire.types import Datum, EncodedTextChunk, ImageChunk, ModelInput

VOCAB = 100
CE, POLICY = ("weights",), ("logprobs", "advantages")


def _datum(inputs: dict[str, torch.Tensor], tokens=(1, 2, 3, 4, 5, 6)) -> Datum:
    return Datum(model_input=ModelInput(chunks=[EncodedTextChunk(tokens=list(tokens))]), loss_fn_inputs=inputs)


def _render(datum: Datum, required=CE):
    return render_training_datum(datum, 1, vocab_size=VOCAB, max_length=64, required_inputs=required)


def test_several_text_chunks_render_to_their_concatenation():
    model_input = ModelInput(chunks=[EncodedTextChunk(tokens=[1, 2]), EncodedTextChunk(tokens=[3]),
                                     EncodedTextChunk(tokens=[4, 5])])
    assert model_input_token_ids(model_input, VOCAB, 64, "prompt") == [1, 2, 3, 4, 5]


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
        render_training_datum(_datum({"target_tokens": torch.arange(6)}), 0, vocab_size=VOCAB, max_length=4,
                              required_inputs=CE)
    image = Datum(model_input=ModelInput(chunks=[ImageChunk(data=b"\x89PNG", format="png")]), loss_fn_inputs=targets)
    with pytest.raises(InvalidRequest, match="image chunks are not supported"):
        _render(image)
    with pytest.raises(InvalidRequest, match="empty"):
        _render(Datum(model_input=ModelInput(chunks=[]), loss_fn_inputs=targets))
