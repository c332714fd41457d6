"""A ModelInput's chunk list -> token ids and prepared images: where both renderers start.

Every image chunk becomes ONE image pad at its place plus its `PreparedImage` (the collapsed view,
what an inference engine takes); `RenderedInput` expands that into the model's own sequence, with
as many pads as the image has tokens (the expanded view, what the client counts positions in and
the trainer runs). Token ids are checked against the vocabulary, a client's text may not contain
media placeholders, and each image's token count is checked against the client's expected_tokens.
Text-only inputs never touch the image code. Knows nothing about losses, engines or HTTP.
"""

from dataclasses import dataclass

import numpy as np
import torch

from server.errors import InvalidRequest, PayloadTooLarge
from server.models.image_processor import PreparedImage
from server.models.loading import LoadedModel, LoadedVision
from server.models.positions import Segment
from server.rendering.images import ImagePreparer
from server.wire.model_input import EncodedTextChunk, ImageAssetPointerChunk, ImageChunk, ModelInput


@dataclass(frozen=True)
class RenderContext:
    """What rendering needs to know about the served model and the server's limits."""

    vocab_size: int
    max_length: int
    """Longest expanded sequence accepted."""
    vision: LoadedVision | None
    """None for a text-only model: image chunks are refused."""
    images: ImagePreparer | None

    @classmethod
    def build(cls, base: LoadedModel, max_length: int, images: ImagePreparer | None) -> "RenderContext":
        return cls(vocab_size=base.vocab_size, max_length=max_length, vision=base.vision, images=images)


@dataclass(frozen=True)
class RenderedInput:
    """A rendered ModelInput in its collapsed form: one image pad per image, at the image's place."""

    token_ids: list[int]
    images: list[PreparedImage]
    image_token_id: int | None
    """The pad id, or None for a text-only model."""

    @property
    def num_positions(self) -> int:
        """Length of the expanded sequence (the client's ModelInput.length)."""
        return len(self.token_ids) + sum(image.num_tokens - 1 for image in self.images)

    def expanded_token_ids(self) -> list[int]:
        """The model's sequence: each image's pad repeated once per image token."""
        if not self.images:
            return self.token_ids
        counts = np.ones(len(self.token_ids), dtype=np.int64)
        counts[self._pad_indices()] = [image.num_tokens for image in self.images]
        return np.repeat(np.asarray(self.token_ids, dtype=np.int64), counts).tolist()

    def segments(self) -> list[Segment]:
        """Runs of text (their lengths) and images (their patch grids), in order."""
        segments: list[Segment] = []
        start = 0
        for index, image in zip(self._pad_indices(), self.images):
            if index > start:
                segments.append(int(index - start))
            segments.append(image.grid_thw)
            start = int(index) + 1
        if start < len(self.token_ids):
            segments.append(len(self.token_ids) - start)
        return segments

    def _pad_indices(self) -> np.ndarray:
        """Where each image's single pad sits in `token_ids` (clients' text never holds one)."""
        return np.flatnonzero(np.asarray(self.token_ids) == self.image_token_id)


def render_model_input(model_input: ModelInput, context: RenderContext, where: str, *,
                       allow_asset_pointers: bool = False) -> RenderedInput:
    """Validate a ModelInput's chunks and prepare its images (a 400 that names `where` otherwise)."""
    token_ids: list[int] = []
    text_ids: list[int] = []
    images: list[PreparedImage] = []
    vision = context.vision
    for index, chunk in enumerate(model_input.chunks):
        at = f"{where} chunk {index}"
        if isinstance(chunk, EncodedTextChunk):
            token_ids.extend(chunk.tokens)
            text_ids.extend(chunk.tokens)
            continue
        if vision is None or context.images is None:
            raise InvalidRequest(f"{at}: this model takes no images ({chunk.type} chunk)")
        if isinstance(chunk, ImageAssetPointerChunk):
            if not allow_asset_pointers:
                raise InvalidRequest(f"{at}: image_asset_pointer chunks are accepted in sampling requests only")
            data = context.images.read_asset(chunk.location, at)
        else:
            assert isinstance(chunk, ImageChunk)
            data = chunk.data
        image = context.images.prepare(data, at)
        if chunk.expected_tokens is not None and chunk.expected_tokens != image.num_tokens:
            # Tinker's wording: clients match on it.
            raise InvalidRequest(f"{at}: Expected {chunk.expected_tokens} tokens, got {image.num_tokens} from image")
        images.append(image)
        token_ids.append(vision.image_token_id)
    if not token_ids:
        raise InvalidRequest(f"{where}: the model input is empty")
    if text_ids and (min(text_ids) < 0 or max(text_ids) >= context.vocab_size):  # C loops; the culprit found after
        bad = next(t for t in text_ids if not 0 <= t < context.vocab_size)
        raise InvalidRequest(f"{where}: token id {bad} is outside the vocabulary [0, {context.vocab_size})")
    if vision is not None and not vision.reserved_token_ids.isdisjoint(text_ids):
        placeholder = next(t for t in text_ids if t in vision.reserved_token_ids)
        raise InvalidRequest(f"{where}: token id {placeholder} is a media placeholder; send images as image chunks, "
                             f"never their placeholder tokens")
    rendered = RenderedInput(token_ids=token_ids, images=images,
                             image_token_id=vision.image_token_id if vision is not None else None)
    if rendered.num_positions > context.max_length:
        raise PayloadTooLarge(f"{where}: {rendered.num_positions} tokens is over the limit of {context.max_length}")
    return rendered


def position_ids(rendered: RenderedInput, vision: LoadedVision) -> torch.Tensor:
    """int64 [3, L] rope positions of the expanded sequence, built the family's way."""
    return vision.spec.position_ids(rendered.segments(), vision.processor.merge_size)
