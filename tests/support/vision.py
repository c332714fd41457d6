"""Builders shared by the tests: the tiny models' render contexts and image bytes of every kind."""

import io

import numpy as np
from PIL import Image

from server.config import ImageConfig, ModelConfig
from server.models.loading import LoadedModel, load_base_model
from server.rendering.chunks import RenderContext, RenderedInput, render_model_input
from server.rendering.images import ImagePreparer
from server.wire.model_input import ModelInput

VISION_MODELS = ["builtin:tiny-qwen2-vl", "builtin:tiny-qwen2.5-vl", "builtin:tiny-qwen3-vl",
                 "builtin:tiny-qwen3-vl-moe", "builtin:tiny-qwen3.5", "builtin:tiny-qwen3.5-moe"]
MAX_LENGTH = 4096


def load(name: str, models_dir) -> LoadedModel:
    return load_base_model(ModelConfig(base_model=name, model_path=None, model_cache_dir=models_dir))


def context_for(base: LoadedModel, config: ImageConfig = ImageConfig(), max_length: int = MAX_LENGTH) -> RenderContext:
    images = ImagePreparer(base.vision.processor, config) if base.vision else None
    return RenderContext.build(base, max_length, images)


def render_prompt(base: LoadedModel, *chunks) -> RenderedInput:
    """A sampling prompt of these chunks, rendered as the server renders it."""
    return render_model_input(ModelInput(chunks=list(chunks)), context_for(base), "prompt")


def encode(image: Image.Image, image_format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
