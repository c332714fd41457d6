"""Image prompts built the way a Tinker client (the cookbook's renderers) builds them, with the real SDK.

expected_tokens comes from client_compat's ImageChunker, which reads transformers' own image
processor from the model directory the server reports (get_info's tokenizer_id), as the cookbook
does: never from the server's code.
"""

import numpy as np
import tinker
from PIL import Image
from tinker import types

from client_compat.images import ImageChunker

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
QUESTION = "What colour is this square?"


class ImagePrompts:
    """Chat-formatted image prompts and supervised datums for one training client's base model."""

    def __init__(self, training_client: tinker.TrainingClient):
        self.tokenizer = training_client.get_tokenizer()
        self.chunker = ImageChunker(training_client.get_info().model_data.tokenizer_id)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def image_chunk(self, image: Image.Image, image_format: str = "png",
                    expected_tokens: int | None = None) -> types.ImageChunk:
        """The image's chunk; `expected_tokens` overrides the true count (to test refusals)."""
        chunk = self.chunker.chunk(image, image_format)
        if expected_tokens is not None:
            chunk = chunk.model_copy(update={"expected_tokens": expected_tokens})
        return chunk

    def user_turn(self, images: list[Image.Image], text: str) -> list:
        """The user's turn: each image between <|vision_start|> and <|vision_end|>, the text, the reply's header."""
        chunks = [types.EncodedTextChunk(tokens=self.ids("<|im_start|>user\n"))]
        for image in images:
            chunks += [types.EncodedTextChunk(tokens=self.ids("<|vision_start|>")), self.image_chunk(image),
                       types.EncodedTextChunk(tokens=self.ids("<|vision_end|>"))]
        chunks.append(types.EncodedTextChunk(tokens=self.ids(f"{text}<|im_end|>\n<|im_start|>assistant\n")))
        return chunks

    def datum(self, prompt_chunks: list, answer: str) -> types.Datum:
        """Supervised datum: weight 1 on the answer (+ <|im_end|>), 0 elsewhere; target 0 at image positions."""
        answer_ids = self.ids(answer + "<|im_end|>")
        tokens = []
        for chunk in prompt_chunks:
            tokens += chunk.tokens if isinstance(chunk, types.EncodedTextChunk) else [0] * chunk.expected_tokens
        tokens += answer_ids
        weights = [0.0] * (len(tokens) - len(answer_ids)) + [1.0] * len(answer_ids)
        model_input = types.ModelInput(chunks=prompt_chunks + [types.EncodedTextChunk(tokens=answer_ids[:-1])])
        return types.Datum(model_input=model_input,
                           loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]})

    def text_targets(self, datum: types.Datum) -> np.ndarray:
        """True where the datum's target is a text token, False where it is an image position."""
        is_text = []
        for chunk in datum.model_input.chunks:
            is_text += [isinstance(chunk, types.EncodedTextChunk)] * chunk.length
        return np.array(is_text[1:] + [True])

    def full_sequence(self, datum: types.Datum) -> types.ModelInput:
        """The datum's input plus its last target: what compute_logprobs scores."""
        last = int(datum.loss_fn_inputs["target_tokens"].tolist()[-1])
        return datum.model_input.append_int(last)


def square(colour: str, size: int, rng: np.random.Generator) -> Image.Image:
    shade = np.clip(np.array(COLOURS[colour]) + rng.integers(-25, 26, 3), 0, 255)
    return Image.new("RGB", (size, size), tuple(int(x) for x in shade))


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
