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


def check_loss_fn_inputs(index: int, num_positions: int, given: dict[str, torch.Tensor],
                         required: tuple[str, ...], vocab_size: int) -> dict[str, torch.Tensor]:
    """The loss inputs a loss needs, shaped like target_tokens ([N] or [N, K], N = rendered length).

    Missing `weights` default to ones; targets become int64 and everything else float32.
    """
    if "target_tokens" not in given:
        raise InvalidRequest(f"datum {index}: loss_fn_inputs needs target_tokens")
    targets = given["target_tokens"].long()
    if targets.dim() not in (1, 2) or targets.shape[0] != num_positions:
        raise InvalidRequest(f"datum {index}: target_tokens has shape {list(targets.shape)} but the model input "
                             f"renders to {num_positions} positions (expected [{num_positions}] or "
                             f"[{num_positions}, K])")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise InvalidRequest(f"datum {index}: target_tokens must be in [0, {vocab_size})")
    inputs = {"target_tokens": targets}
    for name in required:
        if name not in given:
            if name != "weights":
                raise InvalidRequest(f"datum {index}: loss_fn_inputs needs {name}")
            inputs[name] = torch.ones(targets.shape, dtype=torch.float32)
            continue
        value = given[name].float()
        if value.shape != targets.shape:
            raise InvalidRequest(f"datum {index}: {name} has shape {list(value.shape)}, "
                                 f"target_tokens has {list(targets.shape)}")
        inputs[name] = value
    return inputs


def render_training_datum(datum: Datum, index: int, *, vocab_size: int, max_length: int,
                          required_inputs: tuple[str, ...]) -> TrainingExample:
    """One datum as the trainer consumes it, with its loss inputs checked against its rendered length."""
    input_ids = model_input_token_ids(datum.model_input, vocab_size, max_length, f"datum {index}")
    loss_fn_inputs = check_loss_fn_inputs(index, len(input_ids), datum.loss_fn_inputs, required_inputs, vocab_size)
    return TrainingExample(input_ids=input_ids, loss_fn_inputs=loss_fn_inputs)
