"""Training renderer: a Tinker datum (chunk list + loss_fn_inputs) -> the trainer's input.

The client sends <|vision_start|>, the image chunk and <|vision_end|> as separate chunks and never
sends pad tokens: each image chunk becomes exactly as many image pads as the image has tokens
(the expanded view, whose positions the client's target_tokens and weights count), with the
image's pixel values and the family's rope positions. The loss inputs are checked against that
rendered length. Knows nothing about the model's weights or how the trainer batches.
"""

from dataclasses import dataclass, field

import torch

from server.errors import InvalidRequest
from server.models.image_processor import PreparedImage
from server.rendering.chunks import RenderContext, position_ids, render_model_input
from server.wire.model_input import ImageChunk
from server.wire.training import Datum


@dataclass
class TrainingExample:
    input_ids: list[int]
    """The expanded sequence: one image pad per image token."""
    loss_fn_inputs: dict[str, torch.Tensor]
    images: list[PreparedImage] = field(default_factory=list)
    """The datum's images in sequence order; empty for text."""
    position_ids: torch.Tensor | None = None
    """int64 [3, L] multimodal rope positions when the datum has images, else None (plain positions)."""


def check_loss_fn_inputs(index: int, num_positions: int, given: dict[str, torch.Tensor],
                         required: tuple[str, ...], vocab_size: int,
                         optional: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The loss inputs a loss needs (and the optional ones given), shaped like target_tokens ([N] or [N, K]).

    N is the rendered length. Missing `weights` default to ones; targets become int64 and everything
    else float32.
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
    for name in (*required, *(name for name in optional if name in given)):
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


def render_training_datum(datum: Datum, index: int, context: RenderContext, required_inputs: tuple[str, ...],
                          optional_inputs: tuple[str, ...] = ()) -> TrainingExample:
    """One datum as the trainer consumes it, with its loss inputs checked against its rendered length."""
    rendered = render_model_input(datum.model_input, context, f"datum {index}")
    input_ids = rendered.expanded_token_ids()
    loss_fn_inputs = check_loss_fn_inputs(index, len(input_ids), datum.loss_fn_inputs, required_inputs,
                                          context.vocab_size, optional_inputs)
    positions = position_ids(rendered, context.vision) if rendered.images else None
    return TrainingExample(input_ids=input_ids, loss_fn_inputs=loss_fn_inputs, images=rendered.images,
                           position_ids=positions)


def render_training_data(data: list[Datum], context: RenderContext, required_inputs: tuple[str, ...],
                         optional_inputs: tuple[str, ...] = ()) -> list[TrainingExample]:
    """Every datum of a request, in order, their images prepared side by side first (an RL batch brings tens
    of new ones, which would otherwise be decoded one after another before each step)."""
    if context.images is not None:
        context.images.prepare_all([(chunk.data, f"datum {index} chunk {position}")
                                    for index, datum in enumerate(data)
                                    for position, chunk in enumerate(datum.model_input.chunks)
                                    if isinstance(chunk, ImageChunk)])
    return [render_training_datum(datum, index, context, required_inputs, optional_inputs)
            for index, datum in enumerate(data)]
