"""Client-side image chunks: the token count the server computes, for every family and size."""

import numpy as np
from PIL import Image

from client_compat.images import ImageChunker
from server.config import ImageConfig
from server.rendering.images import ImagePreparer

from support.vision import VISION_MODELS, load


def test_chunks_carry_the_token_count_the_server_computes(models_dir):
    rng = np.random.default_rng(0)
    for name in VISION_MODELS:
        base = load(name, models_dir)
        chunker, preparer = ImageChunker(base.path), ImagePreparer(base.vision.processor, ImageConfig())
        for width, height in [(64, 64), (200, 120), (31, 500)] + [tuple(rng.integers(8, 700, 2)) for _ in range(5)]:
            image = Image.fromarray(rng.integers(0, 256, (int(height), int(width), 3), dtype=np.uint8))
            for image_format in ("png", "jpeg"):
                chunk = chunker.chunk(image.convert("L"), image_format)
                assert chunk.format == image_format
                assert chunk.expected_tokens == preparer.prepare(chunk.data, "chunk").num_tokens, (name, width, height)
