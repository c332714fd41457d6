"""Protobuf codec for the binary half of the Tinker wire (schema: `tinker_public.proto`).

Decodes `forward_backward` request bodies (optionally zstd-compressed) into the pydantic types of
`training.py`, and encodes `ForwardBackwardOutput` and `SampleResponse` result payloads. All numeric
blobs are little-endian. It knows byte layouts only: nothing about models, losses or engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pydantic
import torch
import zstandard
from google.protobuf.message import DecodeError

from server.config import LimitsConfig
from server.errors import InvalidRequest, PayloadTooLarge
from server.wire import tinker_public_pb2 as pb
from server.wire.model_input import (DMEL_NOT_SUPPORTED, EncodedTextChunk, ImageChunk, ModelInput, TensorData,
                                     densify_csr)
from server.wire.training import Datum, ForwardBackwardRequest, ProvenanceSpan

MAX_ABS_VALUE = 1e6
"""Loss inputs (weights, advantages, sampler logprobs, clip thresholds) and loss_fn_config numbers
beyond this magnitude are refused: no sensible loss needs them, and they poison a run for good."""
MAX_LOSS_FN_INPUTS = 16
"""loss_fn_inputs of one datum, and loss_fn_config keys: every loss takes a handful."""
_ZSTD_SLICE_BYTES = 1024

# Wire dtype -> how its bytes are read. int32 widens to int64 and bfloat16 to float32.
_WIRE_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
}

# Sentinel the SDK reads as "no entry" in a top-k row (tinker/types/topk_logprobs.py).
TOPK_PAD_TOKEN_ID = 0
TOPK_PAD_LOGPROB = -99999.0


# ---------------------------------------------------------------------------------------------
# forward_backward request


def decode_forward_backward_request(
    body: bytes,
    content_encoding: str | None,
    *,
    max_decompressed_bytes: int = LimitsConfig.max_decompressed_bytes,
) -> ForwardBackwardRequest:
    """Decode a `POST /api/v1/forward_backward` body into a ForwardBackwardRequest.

    Raises InvalidRequest (a ValueError) naming the offending field for any malformed input, and
    PayloadTooLarge when a zstd body inflates past `max_decompressed_bytes`.
    """
    message = _parse_forward_backward(body, content_encoding, max_decompressed_bytes)
    if not message.model_id:
        raise InvalidRequest("forward_backward request has no model_id")
    if not message.loss_fn:
        raise InvalidRequest("forward_backward request has no loss_fn")

    # Numbers are written to both maps and text only to v2; v2 wins where both have a key.
    loss_fn_config: dict[str, float | str] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is not None:
            loss_fn_config[key] = getattr(value, kind)
    if len(loss_fn_config) > MAX_LOSS_FN_INPUTS:
        raise InvalidRequest(f"loss_fn_config has {len(loss_fn_config)} keys, over the limit of {MAX_LOSS_FN_INPUTS}")
    for key, value in loss_fn_config.items():
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= MAX_ABS_VALUE):
            raise InvalidRequest(f"loss_fn_config[{key!r}] is {value}: it must be a finite number of magnitude "
                                 f"at most {MAX_ABS_VALUE:g}")

    return ForwardBackwardRequest(
        model_id=message.model_id,
        seq_id=message.seq_id,
        loss_fn=message.loss_fn,
        loss_fn_config=loss_fn_config,
        forward_only=message.forward_only,
        data=[_decode_datum(datum, f"data[{i}]") for i, datum in enumerate(message.data)],
    )


def read_forward_backward_slot(body: bytes, content_encoding: str | None,
                               max_decompressed_bytes: int) -> tuple[str, int, bool] | None:
    """(model_id, seq_id, forward_only) of a forward_backward body, or None where they cannot be read.

    For refused requests: a body whose datums are malformed may still name its place in the run.
    """
    try:
        message = _parse_forward_backward(body, content_encoding, max_decompressed_bytes)
    except InvalidRequest:
        return None
    if not message.model_id or message.seq_id < 1:
        return None
    return message.model_id, message.seq_id, message.forward_only


def inflate_forward_backward_body(body: bytes, content_encoding: str | None,
                                  max_decompressed_bytes: int) -> bytes:
    """The protobuf bytes of a forward_backward body, whatever its Content-Encoding (zstd or none)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "zstd":
        return _zstd_decompress(body, max_decompressed_bytes)
    if encoding != "identity":
        raise InvalidRequest(f"unsupported Content-Encoding {content_encoding!r} (use zstd or none)")
    return body


def _parse_forward_backward(body: bytes, content_encoding: str | None, max_decompressed_bytes: int
                            ) -> pb.ForwardBackwardRequest:
    body = inflate_forward_backward_body(body, content_encoding, max_decompressed_bytes)
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as error:
        raise InvalidRequest(
            f"forward_backward body is not a valid tinker_public.ForwardBackwardRequest "
            f"protobuf (truncated or corrupt?): {error}"
        ) from None
    return message


def _zstd_decompress(body: bytes, max_bytes: int) -> bytes:
    # A message, not the exception: an exception held in a local would keep this frame (and all that
    # was inflated) alive through its traceback until the cycle collector runs.
    too_large = f"zstd body inflates past the {max_bytes}-byte limit"
    # One growing buffer rather than a list of small parts: past a few MiB it lives in its own
    # mapping, which goes back to the system when freed (a refused bomb leaves no pooled memory).
    inflated = bytearray()
    try:
        if zstandard.frame_content_size(body) > max_bytes:  # -1 when the frame does not say
            raise PayloadTooLarge(too_large)
        decompressor = zstandard.ZstdDecompressor().decompressobj()
        # Small input slices: one byte of zstd inflates to at most ~32 KiB, so a bomb is caught
        # within ~32 MiB of the limit instead of after it has filled memory.
        for start in range(0, len(body), _ZSTD_SLICE_BYTES):
            inflated += decompressor.decompress(body[start : start + _ZSTD_SLICE_BYTES])
            if len(inflated) > max_bytes:
                raise PayloadTooLarge(too_large)
            if decompressor.eof:
                break
    except zstandard.ZstdError as error:
        raise InvalidRequest(f"body is not valid zstd ({error})") from None
    if not decompressor.eof:
        raise InvalidRequest("zstd body is truncated (the frame does not end)")
    if decompressor.unused_data or start + _ZSTD_SLICE_BYTES < len(body):
        raise InvalidRequest("zstd body has bytes after its frame (send a single zstd frame)")
    return bytes(inflated)


def _decode_datum(message: pb.Datum, where: str) -> Datum:
    if len(message.loss_fn_inputs) > MAX_LOSS_FN_INPUTS:
        raise InvalidRequest(f"{where} has {len(message.loss_fn_inputs)} loss_fn_inputs, over the limit of "
                             f"{MAX_LOSS_FN_INPUTS}")
    chunks = [_decode_chunk(c, f"{where}.model_input[{j}]") for j, c in enumerate(message.model_input)]
    # proto3 cannot tell an empty list from an absent one; the SDK sends both lists or neither.
    spans = {
        field: [_decode_span(span, f"{where}.{field}[{j}]") for j, span in enumerate(getattr(message, field))]
        or None
        for field in ("model_input_spans", "loss_fn_input_spans")
    }
    if (spans["model_input_spans"] is None) != (spans["loss_fn_input_spans"] is None):
        raise InvalidRequest(f"{where}: provenance comes as a pair: set both model_input_spans and "
                             f"loss_fn_input_spans or neither")
    return Datum(
        model_input=ModelInput.model_construct(chunks=chunks),
        loss_fn_inputs={
            name: _decode_tensor(tensor, f"{where}.loss_fn_inputs[{name!r}]")
            for name, tensor in message.loss_fn_inputs.items()
        },
        **spans,
    )


def _decode_span(message: pb.ProvenanceSpan, where: str) -> ProvenanceSpan:
    kind = message.WhichOneof("span")
    if kind is None:
        raise InvalidRequest(f"{where} is an empty span (no prompt_tokens or sampled_tokens)")
    run = getattr(message, kind)
    try:
        return ProvenanceSpan(source="prompt" if kind == "prompt_tokens" else "sampled",
                              sequence_id=run.sequence_id, offset=run.offset, length=run.length)
    except pydantic.ValidationError as error:
        problems = "; ".join(f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise InvalidRequest(problems) from None


def _decode_chunk(message: pb.Chunk, where: str) -> EncodedTextChunk | ImageChunk:
    kind = message.WhichOneof("chunk")
    try:
        if kind == "encoded_text":
            tokens = _read_array(message.encoded_text.tokens, np.dtype("<i4"), f"{where}.tokens")
            return EncodedTextChunk(tokens=tokens.tolist())
        if kind == "image":
            image = message.image
            return ImageChunk(
                data=image.data,
                format=image.format,
                expected_tokens=image.expected_tokens if image.HasField("expected_tokens") else None,
            )
    except pydantic.ValidationError as error:
        problems = "; ".join(f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise InvalidRequest(problems) from None
    if kind == "dmel":
        raise InvalidRequest(f"{where}: {DMEL_NOT_SUPPORTED}")
    raise InvalidRequest(f"{where} is an empty chunk (no encoded_text or image)")


def _read_array(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise InvalidRequest(
            f"{where}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte values"
        )
    return np.frombuffer(raw, dtype=dtype)


def _read_values(raw: bytes, wire_dtype: int, where: str) -> np.ndarray:
    """Values in the declared dtype, widened to float32 or int64 (a writable copy)."""
    if wire_dtype not in _WIRE_DTYPES:
        name = pb.DType.Name(wire_dtype) if wire_dtype in pb.DType.values() else str(wire_dtype)
        raise InvalidRequest(f"{where}: unsupported dtype {name} (send float32 or int64)")
    values = _read_array(raw, _WIRE_DTYPES[wire_dtype], where)
    if wire_dtype == pb.DTYPE_BFLOAT16:
        # bfloat16 is the top half of a float32.
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32 if values.dtype.kind == "f" else np.int64)


def _decode_tensor(message: pb.Tensor, where: str) -> torch.Tensor:
    shape = list(message.shape)
    if any(dim < 0 for dim in shape):
        raise InvalidRequest(f"{where}: shape {shape} has a negative dimension")
    if message.WhichOneof("encoding") == "sparse_csr":
        csr = message.sparse_csr
        values = _read_values(csr.values, message.dtype, f"{where}.values")
        crow = _read_array(csr.crow_indices, np.dtype("<i8"), f"{where}.crow_indices")
        col = _read_array(csr.col_indices, np.dtype("<i8"), f"{where}.col_indices")
        _check_magnitude(values, where)
        try:
            dense = densify_csr(values, crow, col, shape)
        except ValueError as error:
            raise InvalidRequest(f"{where}: {error}") from None
        return torch.from_numpy(dense)

    values = _read_values(message.dense, message.dtype, where)
    _check_magnitude(values, where)
    if not shape:
        # proto3 cannot tell an unset shape from a scalar one; the SDK reads a missing shape as 1-D.
        shape = [values.size]
    if math.prod(shape) != values.size:
        raise InvalidRequest(f"{where}: shape {shape} needs {math.prod(shape)} values, got {values.size}")
    return torch.from_numpy(values.reshape(shape))


def _check_magnitude(values: np.ndarray, where: str) -> None:
    if values.dtype.kind == "f" and values.size:
        finite = np.isfinite(values)
        if not finite.all():
            raise InvalidRequest(f"{where} holds {values[~finite][0]} at index {int(np.argmin(finite))}: values "
                                 f"must be finite")
        largest = float(np.abs(values).max())
        if largest > MAX_ABS_VALUE:
            raise InvalidRequest(f"{where} holds a value of magnitude {largest:g}, over the limit of "
                                 f"{MAX_ABS_VALUE:g}")


# ---------------------------------------------------------------------------------------------
# ForwardBackwardOutput


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]],
    metrics: dict[str, float],
    loss_fn_output_type: str = "ArrayRecord",
) -> bytes:
    """Encode per-datum loss outputs and metrics as a ForwardBackwardOutput.

    Args:
        outputs: one dict per datum, every dict with the same field names; each array's first
            dimension is per-datum (e.g. N tokens) and the rest its trailing shape. Floating
            arrays travel as float32, integer and bool arrays as int64.
        metrics: keys must be "name:reduction" (the SDK splits on the one colon).
    """
    message = pb.ForwardBackwardOutput(loss_fn_output_type=loss_fn_output_type)
    for key, value in metrics.items():
        assert key.count(":") == 1, f"metric key {key!r} must look like name:reduction"
        message.metrics[key] = float(value)

    arrays = [{name: _to_wire_array(value) for name, value in datum.items()} for datum in outputs]
    assert all(datum.keys() == arrays[0].keys() for datum in arrays), "datums differ in output fields"
    # One record normally; a new record starts wherever a field's dtype or trailing shape changes
    # (e.g. a different K), because a record's BatchedTensor has one trailing_shape.
    start = 0
    while start < len(arrays):
        end = start + 1
        while end < len(arrays) and _layout(arrays[end]) == _layout(arrays[start]):
            end += 1
        _add_record(message, arrays[start:end], loss_fn_output_type)
        start = end
    return message.SerializeToString()


def _to_wire_array(value: np.ndarray) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim == 0:
        array = array.reshape(1)
    if array.dtype.kind == "f":
        return array.astype("<f4", copy=False)
    if array.dtype.kind in "iub":
        return array.astype("<i8", copy=False)
    raise TypeError(f"cannot send an array of dtype {array.dtype} as a loss output")


def _layout(datum: dict[str, np.ndarray]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, array.dtype.str, array.shape[1:]) for name, array in sorted(datum.items())]


def _add_record(
    message: pb.ForwardBackwardOutput, datums: list[dict[str, np.ndarray]], type_tag: str
) -> None:
    record = message.loss_fn_outputs.add(type_tag=type_tag, num_datums=len(datums))
    for name, first in datums[0].items():
        field = record.fields[name]
        field.dtype = pb.DTYPE_FLOAT32 if first.dtype.kind == "f" else pb.DTYPE_INT64
        field.trailing_shape.extend(first.shape[1:])
        parts = [np.ascontiguousarray(datum[name]).tobytes() for datum in datums]
        field.data = b"".join(parts)
        field.offsets = np.cumsum([0] + [len(part) for part in parts], dtype="<i8").tobytes()


# ---------------------------------------------------------------------------------------------
# SampleResponse

TopkRows = list[list[tuple[int, float]] | None]
"""Per position: up to k (token_id, logprob) pairs, best first, or None where nothing was scored."""


@dataclass
class SampledSequence:
    """One completion: what both sampling engines produce and what the codec sends."""

    tokens: list[int]
    logprobs: list[float] | None
    """Logprob of each token under the model's distribution (no temperature, top-k or top-p), with
    media placeholders at zero probability (server/models/logprobs.py); None sends none."""
    stop_reason: Literal["stop", "length"]
    """"stop" (stop token or stop string) or "length" (max_tokens reached)."""
    topk_logprobs: TopkRows | None = None
    """Per token, its position's k best (token, logprob) of the same distribution (topk_sample_logprobs)."""


_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def encode_sample_response(
    sequences: list[SampledSequence],
    prompt_logprobs: list[float | None] | None = None,
    topk_prompt_logprobs: TopkRows | None = None,
    target_prompt_logprobs: tuple[np.ndarray, TensorData] | None = None,
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None,
    *,
    prompt_cache_hit_tokens: int = 0,
) -> bytes:
    """Encode a SampleResponse.

    Args:
        prompt_logprobs: one entry per prompt position; None (position 0, or before
            prompt_logprobs_last_n) travels as NaN, which the SDK turns back into None.
        target_prompt_logprobs: (logprobs, the request's ids): one float32 per id, sent in the
            ids' layout (dense or CSR).
        prompt_alt_tokens: (token ids, logprobs), each [len(prompt) - 1, k].
    """
    message = pb.SampleResponse(prompt_cache_hit_tokens=prompt_cache_hit_tokens)
    for sequence in sequences:
        out = message.sequences.add(
            stop_reason=_STOP_REASONS[sequence.stop_reason],
            tokens=np.asarray(sequence.tokens, dtype="<i4").tobytes(),
        )
        if sequence.logprobs is not None:
            out.logprobs = np.asarray(sequence.logprobs, dtype="<f4").tobytes()
        if sequence.topk_logprobs is not None:
            _write_topk(out.topk_sampled_logprobs, sequence.topk_logprobs)
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.array(
            [math.nan if value is None else value for value in prompt_logprobs], dtype="<f4"
        ).tobytes()
    if topk_prompt_logprobs is not None:
        _write_topk(message.topk_prompt_logprobs, topk_prompt_logprobs)
    if target_prompt_logprobs is not None:
        logprobs, ids = target_prompt_logprobs
        tensor = message.target_prompt_logprobs
        _write_tensor(tensor, logprobs, ids.shape)
        if ids.sparse_crow_indices is not None:
            tensor.sparse_csr.values = tensor.dense  # the same values, moved into the request's CSR layout
            tensor.sparse_csr.crow_indices = np.asarray(ids.sparse_crow_indices, dtype="<i8").tobytes()
            tensor.sparse_csr.col_indices = np.asarray(ids.sparse_col_indices, dtype="<i8").tobytes()
    if prompt_alt_tokens is not None:
        tokens, logprobs = prompt_alt_tokens
        _write_tensor(message.prompt_alt_tokens.tokens, tokens, tokens.shape)
        _write_tensor(message.prompt_alt_tokens.logprobs, logprobs, logprobs.shape)
    return message.SerializeToString()


def _write_tensor(message: pb.Tensor, values: np.ndarray, shape) -> None:
    """A dense float32 or int64 Tensor."""
    float32 = values.dtype.kind == "f"
    message.dtype = pb.DTYPE_FLOAT32 if float32 else pb.DTYPE_INT64
    message.shape.extend(shape)
    message.dense = np.ascontiguousarray(values, dtype="<f4" if float32 else "<i8").tobytes()


def _write_topk(message: pb.TopkLogprobs, rows: TopkRows) -> None:
    # k >= 1 even when every row is None: the SDK reads k == 0 as "top-k not requested".
    k = max([len(row) for row in rows if row] + [1])
    token_ids = np.full((len(rows), k), TOPK_PAD_TOKEN_ID, dtype="<i4")
    logprobs = np.full((len(rows), k), TOPK_PAD_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token_id, logprob) in enumerate(row or []):
            token_ids[i, j] = token_id
            logprobs[i, j] = logprob
    message.k = k
    message.length = len(rows)
    message.token_ids = token_ids.tobytes()
    message.logprobs = logprobs.tobytes()

