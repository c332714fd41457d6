"""Image chunks to tensors: decoding every mode to RGB, limits, token counts and pixel values like the
model's own processor, and one decode per content hash."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from server.config import ImageConfig
from server.errors import InvalidRequest
from server.rendering import images as images_module
from server.rendering.images import ImagePreparer, decode_rgb

from support.vision import encode, noise_image

CONFIG = ImageConfig()


def _processor(base) -> Qwen2VLImageProcessorPil:
    """transformers' own (PIL-backed) processor, configured from the model's preprocessor_config.json."""
    return Qwen2VLImageProcessorPil.from_pretrained(base.path)


def test_token_counts_equal_the_processors_own_arithmetic(vision_base):
    processor = _processor(vision_base)
    spec = vision_base.vision.processor
    rng = np.random.default_rng(0)
    for height, width in [(64, 64), (224, 224), (224, 150), (300, 400), (1, 300), (4000, 4000), (28, 29)] + \
            [tuple(rng.integers(1, 1500, 2)) for _ in range(200)]:
        if max(height, width) / min(height, width) > 200:
            continue
        expected = processor.get_number_of_image_patches(int(height), int(width), {}) // spec.merge_size ** 2
        assert spec.num_tokens(int(height), int(width)) == expected, (height, width)


def test_pixel_values_match_the_processor_up_to_resampling_rounding(vision_base):
    """Same grid, patch layout and normalisation as transformers. Resampling is the torchvision backend's
    uint8 bicubic (what vLLM runs), which differs from the PIL backend's by a grey level or two on
    under 2 % of values; without resizing the values are exactly the processor's."""
    processor = _processor(vision_base)
    preparer = ImagePreparer(vision_base.vision.processor, CONFIG)
    std_C = torch.tensor(vision_base.vision.processor.image_std)
    for size in [(64, 64), (200, 120), (448, 448), (57, 333)]:
        image = noise_image(*size, seed=size[0])
        ours = preparer.prepare(encode(image), "test")
        theirs = processor(images=[image], return_tensors="pt")
        assert list(theirs["image_grid_thw"][0]) == list(ours.grid_thw)
        assert theirs["pixel_values"].shape == ours.pixel_values.shape
        # Differences in grey levels, per colour channel: [P, C, temporal * patch * patch].
        levels = (theirs["pixel_values"] - ours.pixel_values).abs().reshape(len(ours.pixel_values), 3, -1)
        levels = levels * 255 * std_C[None, :, None]
        assert levels.max() <= 2 + 1e-3 and (levels > 0.5).float().mean() < 0.02
        if tuple(ours.pixels.shape[1:]) == (size[1], size[0]):
            assert levels.max() < 1e-3


@pytest.mark.parametrize("mode", ["L", "LA", "P", "P+transparency", "RGBA", "CMYK", "1", "I;16"])
def test_every_mode_becomes_rgb(mode):
    if mode == "I;16":
        grey = np.linspace(0, 65535, 32 * 16, dtype=np.uint16).reshape(16, 32)
        image = Image.fromarray(grey)  # a 16-bit grey PNG
    elif mode == "P+transparency":
        image = noise_image(32, 16).convert("P")
        image.info["transparency"] = 0
    else:
        image = noise_image(32, 16).convert(mode)
    image_format = "JPEG" if mode == "CMYK" else "PNG"
    rgb = decode_rgb(encode(image, image_format), CONFIG, "img")
    assert rgb.shape == (16, 32, 3) and rgb.dtype == np.uint8
    if mode == "I;16":  # scaled to 8 bits, not clipped at 255
        assert rgb[..., 0].max() == 255 and rgb[0, 0, 0] == 0 and len(np.unique(rgb[..., 0])) > 200


def test_transparency_is_composited_onto_white():
    transparent = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    half = Image.new("RGBA", (8, 8), (0, 0, 0, 128))
    assert (decode_rgb(encode(transparent), CONFIG, "img") == 255).all()
    assert abs(int(decode_rgb(encode(half), CONFIG, "img")[0, 0, 0]) - 127) <= 1


def test_limits_and_corrupt_data_are_refused_with_a_message_naming_the_limit():
    small = ImageConfig(max_image_bytes=1000, max_image_pixels=100 * 100)
    with pytest.raises(InvalidRequest, match="over the limit of 1000 bytes"):
        decode_rgb(encode(noise_image(64, 64)), small, "datum 0 chunk 1")
    # A small PNG that decodes to 400 MB: refused from its header, before any pixel is decoded.
    bomb = encode(Image.new("L", (9000, 9000)))
    assert len(bomb) < 200_000
    with pytest.raises(InvalidRequest, match="9000x9000 pixels is over the limit of 10000 pixels"):
        decode_rgb(bomb, ImageConfig(max_image_pixels=100 * 100), "img")
    for data in (b"", b"not an image", encode(noise_image(16, 16))[:60]):
        with pytest.raises(InvalidRequest, match="img: image data could not be decoded"):
            decode_rgb(data, CONFIG, "img")
    with pytest.raises(InvalidRequest, match="could not be decoded"):
        decode_rgb(encode(noise_image(16, 16), "GIF"), CONFIG, "img")


def test_an_extreme_aspect_ratio_is_refused(qwen2_vl):
    preparer = ImagePreparer(qwen2_vl.vision.processor, CONFIG)
    with pytest.raises(InvalidRequest, match="aspect ratio"):
        preparer.prepare(encode(Image.new("RGB", (1000, 2))), "img")


def test_the_same_bytes_are_decoded_once(qwen2_vl, monkeypatch):
    preparer = ImagePreparer(qwen2_vl.vision.processor, CONFIG)
    decodes = []
    real = images_module.decode_rgb
    monkeypatch.setattr(images_module, "decode_rgb", lambda *args: decodes.append(1) or real(*args))
    data = encode(noise_image(40, 30))
    first, second = preparer.prepare(data, "a"), preparer.prepare(data, "b")
    assert first is second and len(decodes) == 1
    assert preparer.prepare(encode(noise_image(40, 30, seed=1)), "c") is not first and len(decodes) == 2


@pytest.mark.parametrize("host_pixel_values", [True, False])
def test_the_cache_is_bounded_by_the_bytes_its_images_will_hold(qwen2_vl, host_pixel_values):
    image = ImagePreparer(qwen2_vl.vision.processor, CONFIG).prepare(encode(noise_image(64, 64)), "x")
    # Pixels, their PNG, and (on a CPU device) the float32 pixel values: 8x the pixels.
    pixels = image.pixels.numel()
    image_bytes = 2 * pixels + (image.pixel_values.numel() * 4 if host_pixel_values else 0)
    assert image.held_bytes(host_pixel_values) == image_bytes and image.pixel_values.numel() * 4 >= 8 * pixels
    preparer = ImagePreparer(qwen2_vl.vision.processor, ImageConfig(decoded_cache_bytes=3 * image_bytes),
                             host_pixel_values=host_pixel_values)
    for seed in range(10):
        preparer.prepare(encode(noise_image(64, 64, seed=seed)), "x")
    assert len(preparer._cache) == 3 and preparer._cached_bytes == 3 * image_bytes


def test_png_bytes_decode_back_to_the_same_resized_pixels_which_need_no_further_resizing(vision_base):
    preparer = ImagePreparer(vision_base.vision.processor, CONFIG)
    prepared = preparer.prepare(encode(noise_image(200, 120)), "x")
    again = preparer.prepare(prepared.png_bytes, "y")
    assert torch.equal(again.pixels, prepared.pixels)
    torch.testing.assert_close(again.pixel_values, prepared.pixel_values, rtol=0, atol=0)
    assert prepared.pixel_values_on(torch.device("cpu")) is prepared.pixel_values  # derived once on the host


def test_asset_pointers_read_only_files_under_the_image_root(qwen2_vl, tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    (root / "a.png").write_bytes(encode(noise_image(20, 20)))
    (tmp_path / "secret.png").write_bytes(encode(noise_image(20, 20)))
    preparer = ImagePreparer(qwen2_vl.vision.processor, ImageConfig(image_root=root))
    assert preparer.read_asset("a.png", "p") == (root / "a.png").read_bytes()
    assert preparer.read_asset(f"file://{root}/a.png", "p") == (root / "a.png").read_bytes()
    for location, message in [("../secret.png", "outside"), (str(tmp_path / "secret.png"), "outside"),
                              ("https://example.com/a.png", "not a local file"), ("missing.png", "does not exist")]:
        with pytest.raises(InvalidRequest, match=message):
            preparer.read_asset(location, "p")
    with pytest.raises(InvalidRequest, match="--image-root"):
        ImagePreparer(qwen2_vl.vision.processor, CONFIG).read_asset("a.png", "p")
