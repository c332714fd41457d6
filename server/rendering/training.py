"""Training renderer: a Tinker datum (chunk list + loss_fn_inputs) -> the trainer's input.

Text chunks are concatenated into input ids and checked against the vocabulary and the length
limit. Image chunks are refused with a clear error until the vision pipeline lands; this is the
one place they will be expanded into pad tokens and vision tensors.
"""

from dataclasses import dataclass, field

import torch

from server.errors import InvalidRequest, PayloadTooLarge
from server.wire.types import Datum, EncodedTextChunk, ModelInput


@dataclass
class TrainingExample:
    input_ids: list[int]
    loss_fn_inputs: dict[str, torch.Tensor]
    model_kwargs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Extra model inputs of this datum (vision tensors), empty for text."""


def model_input_token_ids(model_input: ModelInput, vocab_size: int, max_length: int, where: str) -> list[int]:
    """Concatenate the text chunks of a ModelInput, validating every token id and the length."""
    input_ids: list[int] = []
    for chunk in model_input.chunks:
        if not isinstance(chunk, EncodedTextChunk):
            raise InvalidRequest(f"{where}: {chunk.type} chunks are not supported by this server yet")
        input_ids.extend(chunk.tokens)
    if not input_ids:
        raise InvalidRequest(f"{where}: the model input is empty")
    bad = next((t for t in input_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(input_ids) > max_length:
        raise PayloadTooLarge(f"{where}: {len(input_ids)} tokens is over the limit of {max_length}")
    return input_ids


def render_training_datum(datum: Datum, index: int, vocab_size: int, max_length: int) -> TrainingExample:
    """One datum as the trainer consumes it."""
    input_ids = model_input_token_ids(datum.model_input, vocab_size, max_length, f"datum {index}")
    return TrainingExample(input_ids=input_ids, loss_fn_inputs=dict(datum.loss_fn_inputs))
