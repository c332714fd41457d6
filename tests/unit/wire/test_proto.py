"""The protobuf codec against the real SDK: requests built and serialized by `tinker`, results
decoded by `tinker.proto.response_conv`."""

import numpy as np
import pytest
import torch
import zstandard
from tinker import types as sdk
from tinker.proto import response_conv
from tinker.proto import tinker_public_pb2 as sdk_pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.lib.public_interfaces.sampling_client import _tensor_data_to_model as sent_as_json

from server.errors import InvalidRequest, PayloadTooLarge
from server.wire import tinker_public_pb2 as pb
from server.wire.model_input import EncodedTextChunk, ImageChunk
from server.wire.proto import (
    SampledSequence,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)
from server.wire.sampling import SampleRequest

PNG_BYTES = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3


def sdk_body(data, loss_fn="cross_entropy", loss_fn_config=None, forward_only=False, seq_id=3):
    """Serialize exactly as tinker.resources.training.forward_backward does."""
    request = sdk.ForwardBackwardRequest(
        forward_backward_input=sdk.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config
        ),
        model_id="S:train:0",
        seq_id=seq_id,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def image_datum():
    """Text, an image of 4 tokens, text: 8 positions, with dense 1-D and sparse 2-D inputs."""
    targets_2d = torch.zeros(8, 6, dtype=torch.int64)
    targets_2d[:, 0] = torch.arange(100, 108)
    targets_2d[7, 3] = 42
    weights_2d = torch.zeros(8, 6)
    weights_2d[5:, 0] = 1.0
    return sdk.Datum(
        model_input=sdk.ModelInput(
            chunks=[
                sdk.EncodedTextChunk(tokens=[1, 2]),
                sdk.ImageChunk(data=PNG_BYTES, format="png", expected_tokens=4),
                sdk.EncodedTextChunk(tokens=[3, 70000]),
            ]
        ),
        loss_fn_inputs={"target_tokens": targets_2d, "weights": weights_2d},
    )


def text_datum():
    return sdk.Datum(
        model_input=sdk.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={
            "target_tokens": [6, 7, 8],
            "logprobs": np.array([-0.5, -1.5, -2.5], dtype=np.float32),
            "advantages": [1.0, 0.0, -1.0],
        },
    )


def test_sdk_request_with_image_and_sparse_2d_targets_decodes_field_by_field():
    body = sdk_body(
        [image_datum(), text_datum()],
        loss_fn="ppo",
        loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "note": "text"},
        forward_only=True,
    )
    sent = sdk_pb.ForwardBackwardRequest.FromString(body)
    # The SDK really did choose CSR for the 2-D tensors, so this test covers that path.
    assert sent.data[0].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "sparse_csr"
    assert sent.data[0].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"

    request = decode_forward_backward_request(body, None)

    assert (request.model_id, request.seq_id, request.loss_fn) == ("S:train:0", 3, "ppo")
    assert request.forward_only is True
    assert request.loss_fn_config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "note": "text"}
    assert isinstance(request.loss_fn_config["clip_low_threshold"], float)

    first, second = request.data
    chunks = first.model_input.chunks
    assert chunks[0] == EncodedTextChunk(tokens=[1, 2])
    assert chunks[1] == ImageChunk(data=PNG_BYTES, format="png", expected_tokens=4)
    assert chunks[2] == EncodedTextChunk(tokens=[3, 70000])
    expected = image_datum().loss_fn_inputs
    for name in ("target_tokens", "weights"):
        assert torch.equal(first.loss_fn_inputs[name], expected[name].to_torch())
    assert first.loss_fn_inputs["target_tokens"].dtype == torch.int64
    assert first.loss_fn_inputs["weights"].dtype == torch.float32
    assert first.loss_fn_inputs["weights"].shape == (8, 6)

    assert second.model_input.chunks == [EncodedTextChunk(tokens=[5, 6, 7])]
    assert torch.equal(second.loss_fn_inputs["target_tokens"], torch.tensor([6, 7, 8]))
    assert torch.equal(second.loss_fn_inputs["logprobs"], torch.tensor([-0.5, -1.5, -2.5]))
    assert torch.equal(second.loss_fn_inputs["advantages"], torch.tensor([1.0, 0.0, -1.0]))


def test_dense_2d_targets_keep_their_shape():
    targets = torch.arange(12, dtype=torch.int64).reshape(4, 3) + 1  # no zeros: SDK stays dense
    datum = sdk.Datum(
        model_input=sdk.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": targets, "weights": torch.ones(4, 3)},
    )
    body = sdk_body([datum])
    assert sdk_pb.ForwardBackwardRequest.FromString(body).data[0].loss_fn_inputs[
        "target_tokens"
    ].WhichOneof("encoding") == "dense"
    decoded = decode_forward_backward_request(body, None).data[0].loss_fn_inputs
    assert torch.equal(decoded["target_tokens"], targets)
    assert torch.equal(decoded["weights"], torch.ones(4, 3))


def test_zstd_compressed_body_decodes_like_the_plain_one():
    body = sdk_body([image_datum(), text_datum()], forward_only=False)
    compressed = zstandard.ZstdCompressor().compress(body)  # as the SDK does with proto_compress_fwdbwd
    plain = decode_forward_backward_request(body, None)
    unzipped = decode_forward_backward_request(compressed, "zstd")
    assert unzipped.model_dump(exclude={"data"}) == plain.model_dump(exclude={"data"})
    for a, b in zip(unzipped.data, plain.data, strict=True):
        assert a.model_input == b.model_input
        assert a.loss_fn_inputs.keys() == b.loss_fn_inputs.keys()
        assert all(torch.equal(a.loss_fn_inputs[k], b.loss_fn_inputs[k]) for k in a.loss_fn_inputs)


def test_loss_fn_config_v2_wins_over_v1_and_v1_alone_is_read():
    message = pb.ForwardBackwardRequest(model_id="M", seq_id=1, loss_fn="dro")
    message.loss_fn_config["beta"] = 0.1
    message.loss_fn_config["legacy_only"] = 2.0
    message.loss_fn_config_v2["beta"].number = 0.05
    message.loss_fn_config_v2["mode"].text = "kl"
    request = decode_forward_backward_request(message.SerializeToString(), "identity")
    assert request.loss_fn_config == {"beta": 0.05, "legacy_only": 2.0, "mode": "kl"}


def test_int32_and_bfloat16_tensors_widen_to_int64_and_float32():
    message = pb.ForwardBackwardRequest(model_id="M", seq_id=1, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], dtype="<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype = pb.DTYPE_INT32
    targets.shape.extend([2])
    targets.dense = np.array([7, -1], dtype="<i4").tobytes()
    weights = datum.loss_fn_inputs["weights"]
    weights.dtype = pb.DTYPE_BFLOAT16
    weights.shape.extend([2])
    bf16 = torch.tensor([0.5, -3.0], dtype=torch.bfloat16).view(torch.int16).numpy().astype("<i2")
    weights.dense = bf16.tobytes()

    inputs = decode_forward_backward_request(message.SerializeToString(), None).data[0].loss_fn_inputs
    assert inputs["target_tokens"].dtype == torch.int64
    assert inputs["target_tokens"].tolist() == [7, -1]
    assert inputs["weights"].dtype == torch.float32
    assert inputs["weights"].tolist() == [0.5, -3.0]


def test_decoded_tensors_are_writable_and_own_their_memory():
    body = sdk_body([text_datum()])
    tensor = decode_forward_backward_request(body, None).data[0].loss_fn_inputs["logprobs"]
    tensor.add_(1.0)  # would fail or warn on a read-only protobuf buffer
    assert tensor.tolist() == [0.5, -0.5, -1.5]


# ---------------------------------------------------------------------------------------------
# Malformed requests


def test_truncated_protobuf_is_a_value_error_that_says_so():
    body = sdk_body([image_datum()])
    with pytest.raises(ValueError, match="not a valid tinker_public.ForwardBackwardRequest"):
        decode_forward_backward_request(body[: len(body) // 2], None)


def test_zstd_bomb_is_refused_before_it_is_inflated():
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (4 << 20))
    with pytest.raises(PayloadTooLarge, match="inflates past"):
        decode_forward_backward_request(bomb, "zstd", max_decompressed_bytes=1 << 20)


def test_zstd_bomb_without_declared_size_is_refused_while_streaming():
    compressor = zstandard.ZstdCompressor(write_content_size=False)
    bomb = compressor.compress(b"\0" * (4 << 20))
    assert zstandard.frame_content_size(bomb) == -1
    with pytest.raises(PayloadTooLarge):
        decode_forward_backward_request(bomb, "zstd", max_decompressed_bytes=1 << 20)
    assert issubclass(PayloadTooLarge, ValueError)


def test_body_that_is_not_zstd_is_a_value_error():
    with pytest.raises(ValueError, match="not valid zstd"):
        decode_forward_backward_request(b"definitely not zstd", "zstd")


def test_truncated_zstd_body_is_refused():
    body = zstandard.ZstdCompressor().compress(sdk_body([image_datum()]))
    with pytest.raises(ValueError, match="zstd body is truncated"):
        decode_forward_backward_request(body[:-4], "zstd")


def test_unknown_content_encoding_is_refused():
    with pytest.raises(ValueError, match="Content-Encoding 'gzip'"):
        decode_forward_backward_request(sdk_body([text_datum()]), "gzip")


def test_dmel_chunk_is_refused_with_a_clear_message():
    datum = sdk.Datum(
        model_input=sdk.ModelInput(chunks=[sdk.DmelChunk(dmel=b"\x00\x01")]),
        loss_fn_inputs={"target_tokens": [1], "weights": [1.0]},
    )
    with pytest.raises(ValueError, match=r"data\[0\]\.model_input\[0\]: audio \(dmel\) chunks are not supported"):
        decode_forward_backward_request(sdk_body([datum]), None)


def test_missing_model_id_is_refused():
    message = pb.ForwardBackwardRequest(seq_id=1, loss_fn="cross_entropy")
    with pytest.raises(InvalidRequest, match="no model_id"):
        decode_forward_backward_request(message.SerializeToString(), None)


def make_request_with_tensor(dtype, raw, shape):
    message = pb.ForwardBackwardRequest(model_id="M", seq_id=1, loss_fn="cross_entropy")
    tensor = message.data.add().loss_fn_inputs["weights"]
    tensor.dtype = dtype
    tensor.shape.extend(shape)
    tensor.dense = raw
    return message.SerializeToString()


def test_tensor_shape_that_does_not_match_its_data_is_refused():
    body = make_request_with_tensor(pb.DTYPE_FLOAT32, np.zeros(5, "<f4").tobytes(), [2, 3])
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['weights'\]: shape \[2, 3\] needs 6 values, got 5"):
        decode_forward_backward_request(body, None)


def test_tensor_bytes_that_are_not_whole_values_are_refused():
    body = make_request_with_tensor(pb.DTYPE_INT64, b"\0" * 12, [1])
    with pytest.raises(ValueError, match="12 bytes is not a whole number of 8-byte values"):
        decode_forward_backward_request(body, None)


def test_tensor_without_dtype_is_refused():
    body = make_request_with_tensor(pb.DTYPE_UNSPECIFIED, b"\0" * 4, [1])
    with pytest.raises(ValueError, match="unsupported dtype DTYPE_UNSPECIFIED"):
        decode_forward_backward_request(body, None)


def test_sparse_tensor_with_inconsistent_indices_is_refused():
    message = pb.ForwardBackwardRequest(model_id="M", seq_id=1, loss_fn="cross_entropy")
    tensor = message.data.add().loss_fn_inputs["target_tokens"]
    tensor.dtype = pb.DTYPE_INT64
    tensor.shape.extend([2, 3])
    tensor.sparse_csr.values = np.array([5, 6], "<i8").tobytes()
    tensor.sparse_csr.crow_indices = np.array([0, 1, 3], "<i8").tobytes()  # claims 3 values
    tensor.sparse_csr.col_indices = np.array([0, 2], "<i8").tobytes()
    with pytest.raises(ValueError, match="crow_indices must start at 0"):
        decode_forward_backward_request(message.SerializeToString(), None)


def test_text_tokens_that_are_not_whole_int32_values_are_refused():
    message = pb.ForwardBackwardRequest(model_id="M", seq_id=1, loss_fn="cross_entropy")
    message.data.add().model_input.add().encoded_text.tokens = b"\1\0\0"
    with pytest.raises(ValueError, match=r"model_input\[0\]\.tokens: 3 bytes"):
        decode_forward_backward_request(message.SerializeToString(), None)


def test_image_chunk_with_unknown_format_is_refused():
    message = pb.ForwardBackwardRequest(model_id="M", seq_id=1, loss_fn="cross_entropy")
    image = message.data.add().model_input.add().image
    image.data = PNG_BYTES
    image.format = "gif"
    with pytest.raises(InvalidRequest, match=r"model_input\[0\].*format"):
        decode_forward_backward_request(message.SerializeToString(), None)


# ---------------------------------------------------------------------------------------------
# ForwardBackwardOutput, read back by the SDK


def test_forward_backward_output_decodes_in_the_sdk_per_datum():
    outputs = [
        {"logprobs": np.array([-1.0, -2.0, -3.0]), "elementwise_loss": np.array([1.0, 2.0, 3.0], np.float32)},
        {"logprobs": np.array([-0.5]), "elementwise_loss": np.array([0.5], np.float32)},
    ]
    body = encode_forward_backward_output(outputs, {"loss:sum": 6.5, "num_tokens:sum": 4})

    result = response_conv.deserialize_forward_backward_output(body)
    assert result.loss_fn_output_type == "ArrayRecord"
    assert result.metrics == {"loss:sum": 6.5, "num_tokens:sum": 4.0}
    assert len(result.loss_fn_outputs) == 2
    for ours, theirs in zip(outputs, result.loss_fn_outputs, strict=True):
        for name, array in ours.items():
            assert theirs[name].dtype == "float32"
            assert theirs[name].shape == [len(array)]
            np.testing.assert_array_equal(theirs[name].to_numpy(), array.astype(np.float32))
    assert len(response_conv.public_pb.ForwardBackwardOutput.FromString(body).loss_fn_outputs) == 1


def test_two_dimensional_and_integer_outputs_keep_trailing_shape_and_dtype():
    outputs = [
        {"logprobs": np.arange(6, dtype=np.float32).reshape(3, 2), "argmax": np.array([4, 5, 6])},
        {"logprobs": np.arange(2, dtype=np.float32).reshape(1, 2), "argmax": np.array([7], np.int32)},
    ]
    result = response_conv.deserialize_forward_backward_output(encode_forward_backward_output(outputs, {}))
    assert result.loss_fn_outputs[0]["logprobs"].shape == [3, 2]
    assert result.loss_fn_outputs[1]["logprobs"].shape == [1, 2]
    np.testing.assert_array_equal(result.loss_fn_outputs[0]["logprobs"].to_numpy(), outputs[0]["logprobs"])
    assert result.loss_fn_outputs[1]["argmax"].dtype == "int64"
    assert result.loss_fn_outputs[1]["argmax"].tolist() == [7]


def test_outputs_with_different_trailing_shapes_travel_as_separate_records():
    outputs = [
        {"logprobs": np.zeros((2, 3), np.float32)},
        {"logprobs": np.ones((4, 5), np.float32)},
        {"logprobs": np.ones((1, 5), np.float32)},
    ]
    body = encode_forward_backward_output(outputs, {"loss:sum": 0.0})
    assert [r.num_datums for r in pb.ForwardBackwardOutput.FromString(body).loss_fn_outputs] == [1, 2]
    result = response_conv.deserialize_forward_backward_output(body)
    assert [o["logprobs"].shape for o in result.loss_fn_outputs] == [[2, 3], [4, 5], [1, 5]]


def test_empty_outputs_give_an_empty_list_in_the_sdk():
    result = response_conv.deserialize_forward_backward_output(
        encode_forward_backward_output([], {"loss:sum": 0.0})
    )
    assert result.loss_fn_outputs == []
    assert result.metrics == {"loss:sum": 0.0}


# ---------------------------------------------------------------------------------------------
# SampleResponse, read back by the SDK


def test_sample_response_decodes_in_the_sdk():
    sequences = [
        SampledSequence(tokens=[11, 12, 13], logprobs=[-0.1, -0.2, -0.3], stop_reason="stop"),
        SampledSequence(tokens=[14], logprobs=None, stop_reason="length"),
    ]
    body = encode_sample_response(sequences, prompt_logprobs=[None, -1.25, -2.5], prompt_cache_hit_tokens=2)
    result = response_conv.deserialize_sample_response(body)

    assert [s.tokens for s in result.sequences] == [[11, 12, 13], [14]]
    assert [s.stop_reason for s in result.sequences] == ["stop", "length"]
    assert result.sequences[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert result.sequences[1].logprobs is None
    assert result.prompt_logprobs == [None, -1.25, -2.5]
    assert result.topk_prompt_logprobs is None
    assert result.prompt_cache_hit_tokens == 2


def test_sample_response_without_prompt_logprobs_reads_as_none():
    body = encode_sample_response([SampledSequence(tokens=[1], logprobs=[-0.5], stop_reason="length")])
    assert response_conv.deserialize_sample_response(body).prompt_logprobs is None


def test_topk_rows_are_padded_with_sentinels_the_sdk_strips():
    prompt_topk = [None, [(5, -0.1), (6, -2.0)], [(7, -0.3)]]
    sequences = [SampledSequence(tokens=[9, 3], logprobs=[-0.01, -1.0], stop_reason="stop")]
    body = encode_sample_response(sequences, [None, -0.1, -0.3], prompt_topk)
    message = pb.SampleResponse.FromString(body)
    assert (message.topk_prompt_logprobs.k, message.topk_prompt_logprobs.length) == (2, 3)
    padded = np.frombuffer(message.topk_prompt_logprobs.logprobs, "<f4").reshape(3, 2)
    assert padded[0].tolist() == [-99999.0, -99999.0]

    result = response_conv.deserialize_sample_response(body)
    expected_prompt = [None, [(5, pytest.approx(-0.1)), (6, -2.0)], [(7, pytest.approx(-0.3))]]
    assert result.topk_prompt_logprobs == expected_prompt


def test_topk_with_every_row_empty_still_reads_as_requested():
    body = encode_sample_response(
        [SampledSequence(tokens=[1], logprobs=[-1.0], stop_reason="stop")], [None], [None]
    )
    assert response_conv.deserialize_sample_response(body).topk_prompt_logprobs == [None]


def test_sampled_top_k_target_logprobs_and_alt_tokens_decode_in_the_sdk_in_the_requests_layout():
    sequences = [SampledSequence(tokens=[9, 3], logprobs=[-0.5, -1.0], stop_reason="stop",
                                    topk_logprobs=[[(9, -0.5), (4, -0.75)], [(2, -0.25)]])]
    ids = torch.full((4, 3), -1)
    ids[0, 0], ids[3, 2] = 5, 9
    sparse = sdk.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    for targets in (sdk.TensorData.from_torch(ids), sparse):
        request = SampleRequest.model_validate({
            "base_model": "b", "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4, 5]}]},
            "sampling_params": {}, "target_prompt_logprobs": sent_as_json(targets).model_dump(mode="json")})
        rows, cells = request.target_prompt_logprobs.cells()
        logprobs = np.where(cells >= 0, -0.5 * (rows + 1), 0.0).astype(np.float32)  # what the route fills in
        alt = (np.array([[7, 7], [8, 1], [2, 2], [4, 4]]), np.linspace(-1, 0, 8, dtype=np.float32).reshape(4, 2))
        result = response_conv.deserialize_sample_response(encode_sample_response(
            sequences, target_prompt_logprobs=(logprobs, request.target_prompt_logprobs), prompt_alt_tokens=alt))

        assert result.target_prompt_logprobs.sparse_crow_indices == targets.sparse_crow_indices
        expected = torch.zeros(4, 3)
        expected[0, 0], expected[3, 2] = -0.5, -2.0
        assert result.target_prompt_logprobs.to_torch().tolist() == expected.tolist()
        assert result.prompt_alt_tokens.tokens.to_numpy().tolist() == alt[0].tolist()
        np.testing.assert_array_equal(result.prompt_alt_tokens.logprobs.to_numpy(), alt[1])
        assert result.sequences[0].topk_logprobs == [[(9, -0.5), (4, -0.75)], [(2, -0.25)]]
        assert result.prompt_logprobs is None and result.topk_prompt_logprobs is None


def test_our_generated_module_is_the_sdk_schema():
    assert pb.DESCRIPTOR.serialized_pb == sdk_pb.DESCRIPTOR.serialized_pb


def test_provenance_spans_from_the_sdk_decode_in_order_with_their_kind_offset_and_length():
    datum = text_datum().with_provenance(
        model_input=[sdk.PromptProvenanceSpan(sequence_id="S:sample:0:seq:1:0", length=2),
                     sdk.SampledProvenanceSpan(sequence_id="S:sample:0:seq:1:0", offset=0, length=1)],
        loss_fn_inputs=[sdk.PromptProvenanceSpan(sequence_id="S:sample:0:seq:1:0", offset=1, length=1),
                        sdk.SampledProvenanceSpan(sequence_id="S:sample:0:seq:1:0", offset=0, length=2)])

    decoded = decode_forward_backward_request(sdk_body([datum, text_datum()], loss_fn="stable_reinforce"), None)

    spans = decoded.data[0]
    assert [(s.source, s.sequence_id, s.offset, s.length) for s in spans.model_input_spans] == [
        ("prompt", "S:sample:0:seq:1:0", 0, 2), ("sampled", "S:sample:0:seq:1:0", 0, 1)]
    assert [(s.source, s.offset, s.length) for s in spans.loss_fn_input_spans] == [("prompt", 1, 1), ("sampled", 0, 2)]
    assert decoded.data[1].model_input_spans is None and decoded.data[1].loss_fn_input_spans is None


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.ClearField("loss_fn_input_spans"), "provenance comes as a pair"),
    (lambda d: d.model_input_spans[0].prompt_tokens.ClearField("sequence_id"), "sequence_id"),
    (lambda d: setattr(d.model_input_spans[0].prompt_tokens, "length", -1), "length"),
    (lambda d: d.model_input_spans.add(), "empty span"),
])
def test_malformed_provenance_spans_are_refused_with_the_datum_named(edit, message):
    datum = text_datum().with_provenance(
        model_input=[sdk.PromptProvenanceSpan(sequence_id="seq", length=3)],
        loss_fn_inputs=[sdk.SampledProvenanceSpan(sequence_id="seq", length=3)])
    message_pb = pb.ForwardBackwardRequest.FromString(sdk_body([text_datum(), datum]))
    edit(message_pb.data[1])
    with pytest.raises(InvalidRequest, match=message) as raised:
        decode_forward_backward_request(message_pb.SerializeToString(), None)
    assert "data[1]" in str(raised.value)
