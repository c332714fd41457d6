"""Image chunks built on the client, offline, with the expected_tokens a server will check.

The count comes from the model's own image processor, read from its directory (the path a
self-hosted server reports as get_info's tokenizer_id), exactly as the cookbook's renderers
compute it: no hub, no server call. PNG keeps the pixels and the image's mode (the server turns
every mode into RGB); JPEG is smaller for photographs. The one builder of image chunks in the project.
"""

import io
from pathlib import Path

from PIL import Image
from tinker import types
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


class ImageChunker:
    """Makes `ImageChunk`s for one model: `ImageChunker(training_client.get_info().model_data.tokenizer_id)`."""

    def __init__(self, model_dir: str | Path):
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)

    def num_tokens(self, width: int, height: int) -> int:
        """Image tokens the model gives an image of this size (pads only, not vision_start/end)."""
        patches = self.processor.get_number_of_image_patches(height, width, {})
        return patches // self.processor.merge_size ** 2

    def chunk(self, image: Image.Image, image_format: str = "png") -> types.ImageChunk:
        """The image encoded as PNG (any mode) or JPEG (converted to RGB, which JPEG needs)."""
        if image_format not in ("png", "jpeg"):
            raise ValueError(f"image_format must be png or jpeg, got {image_format!r}")
        buffer = io.BytesIO()
        (image if image_format == "png" else image.convert("RGB")).save(buffer, format=image_format.upper())
        return types.ImageChunk(data=buffer.getvalue(), format=image_format,
                                expected_tokens=self.num_tokens(image.width, image.height))
