"""The model's image processor as data: patch and merge sizes, pixel range, normalisation.

Read from the checkpoint's own preprocessor_config.json, so the token count of an image (what a
client's ImageChunk.expected_tokens must equal) is the processor's own arithmetic. Decoding and
resizing pixels is `server/rendering/images.py`'s job, not this module's.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from server.errors import InvalidRequest

# Image processors whose arithmetic this module implements (preprocessor_config.json's image_processor_type).
SUPPORTED_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
_BICUBIC = 3  # PIL's resample code; the Qwen-VL checkpoints all resize bicubically


@dataclass(frozen=True)
class ImageProcessorSpec:
    """What the model's image processor does, as read from its preprocessor_config.json."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> "ImageProcessorSpec":
        config = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        kind = config.get("image_processor_type")
        if kind not in SUPPORTED_PROCESSORS:
            raise ValueError(f"image processor {kind!r} is not supported; supported: {SUPPORTED_PROCESSORS}")
        if config.get("resample", _BICUBIC) != _BICUBIC or not config.get("do_resize", True):
            raise ValueError("only bicubic resizing (resample=3) is supported")
        # As the processor itself does: `size` first, then min_pixels/max_pixels override it.
        size = config.get("size") or {}
        return cls(
            patch_size=config["patch_size"],
            merge_size=config["merge_size"],
            temporal_patch_size=config["temporal_patch_size"],
            min_pixels=config.get("min_pixels", size.get("shortest_edge", 56 * 56)),
            max_pixels=config.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280)),
            image_mean=tuple(config["image_mean"]),
            image_std=tuple(config["image_std"]),
            rescale_factor=config.get("rescale_factor", 1 / 255),
        )

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the processor resizes an image to: multiples of patch * merge within the pixel range."""
        try:
            return smart_resize(height, width, factor=self.patch_size * self.merge_size,
                                min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        except ValueError as error:  # an aspect ratio over 200
            raise InvalidRequest(f"image of {width}x{height} pixels: {error}") from None

    def num_tokens(self, height: int, width: int) -> int:
        """Image pad tokens an image of this size becomes (what ImageChunk.expected_tokens must equal)."""
        resized_height, resized_width = self.resized_size(height, width)
        return resized_height * resized_width // (self.patch_size * self.merge_size) ** 2
