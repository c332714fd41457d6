"""The model's image processor as data: patch and merge sizes, pixel range, normalisation.

Read from the checkpoint's own preprocessor_config.json, so the token count of an image (what a
client's ImageChunk.expected_tokens must equal) is the processor's own arithmetic. Decoding and
resizing pixels is `server/rendering/images.py`'s job; it hands back a `PreparedImage`, defined here so that
the vision tower (models/) and the renderers (rendering/) share it without models importing rendering.
"""

import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

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


@dataclass(frozen=True)
class PreparedImage:
    """One decoded image, ready for the vision tower (pixel_values) or for vLLM (pixels).

    Only the uint8 pixels travel when it is sent to another training rank: `pixel_values`
    (eight times larger) is derived where it is needed, and only where the features are not cached.
    """

    sha256: str
    """Hex digest of the encoded bytes: the key of every cache of this image."""
    pixels: torch.Tensor
    """uint8 [C, H, W], RGB, already resized to the processor's size (so resizing it again is a no-op)."""
    grid_thw: tuple[int, int, int]
    """Patch grid (temporal, height, width) before merging, as image_grid_thw holds it."""
    num_tokens: int
    """Image pad tokens of this image in the model's sequence."""
    processor: ImageProcessorSpec

    @functools.cached_property
    def pixel_values(self) -> torch.Tensor:
        """float32 [P, C * temporal_patch * patch * patch] in the processor's patch order, on the host."""
        return self._patchify(torch.device("cpu"))

    def pixel_values_on(self, device: torch.device) -> torch.Tensor:
        """`pixel_values` on `device`, computed there from the uint8 pixels: the same IEEE operations give the
        same values, and on a GPU no host thread works per image (many ranks' threads on one host's cores
        made that host work ten times slower) and an eighth of the bytes is copied."""
        return self.pixel_values if device.type == "cpu" else self._patchify(device)

    def _patchify(self, device: torch.device) -> torch.Tensor:
        spec = self.processor
        # Rescale and normalise in one step, as the processor fuses them: (x - mean / r) / (std / r).
        mean = torch.tensor(spec.image_mean, dtype=torch.float32) * (1.0 / spec.rescale_factor)
        std = torch.tensor(spec.image_std, dtype=torch.float32) * (1.0 / spec.rescale_factor)
        normalized_CHW = ((self.pixels.to(device).float() - mean.to(device)[:, None, None])
                          / std.to(device)[:, None, None])
        p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
        _, grid_h, grid_w = self.grid_thw
        # [C, gh/m, m, p, gw/m, m, p] -> [gh/m, gw/m, m, m, C, p, p]: merged 2x2 groups of patches are contiguous.
        patches = normalized_CHW.reshape(3, grid_h // m, m, p, grid_w // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        # A still image is its own temporal patch: each patch repeats `t` times along time.
        patches = patches.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)
        return patches.reshape(grid_h * grid_w, 3 * t * p * p).contiguous()

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name not in ("pixel_values", "png_bytes")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def held_bytes(self, host_pixel_values: bool) -> int:
        """Bytes held once derived (caches count them up front): the pixels and their PNG (about their size at
        most), and the host's pixel values where they are derived (a CPU device: 8x the pixels)."""
        _, grid_h, grid_w = self.grid_thw
        spec = self.processor
        pixel_values = grid_h * grid_w * 3 * spec.temporal_patch_size * spec.patch_size ** 2 * 4
        return 2 * self.pixels.numel() + (pixel_values if host_pixel_values else 0)

    @functools.cached_property
    def png_bytes(self) -> bytes:
        """The resized RGB pixels as a lossless PNG (what an external engine decodes back exactly). zlib's fastest
        level: a sixth of the default's time for a 448x448 photo-like image, a quarter more bytes, which cross
        no network (benchmarks/image_encoding.py)."""
        buffer = io.BytesIO()
        Image.fromarray(self.pixels.permute(1, 2, 0).numpy()).save(buffer, format="PNG", compress_level=1)
        return buffer.getvalue()
