"""On a GPU (`pytest -m gpu tests/gpu`): pixel values computed on the device from the uint8 pixels equal the
host's bit for bit, so the vision features the trainer and the samplers see do not depend on where they
were patched."""

import pytest
import torch

from server.config import ImageConfig
from server.models.builtin import ensure_builtin_model
from server.models.image_processor import ImageProcessorSpec
from server.rendering.images import ImagePreparer

from support.vision import encode, noise_image

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen3-vl"])  # patches of 14 and of 16 pixels
def test_pixel_values_on_the_gpu_equal_the_hosts_exactly(name, models_dir):
    spec = ImageProcessorSpec.from_model_dir(ensure_builtin_model(name, models_dir))
    preparer = ImagePreparer(spec, ImageConfig())
    for size in [(448, 448), (200, 120), (57, 333)]:
        image = preparer.prepare(encode(noise_image(*size, seed=size[0])), "x")
        assert torch.equal(image.pixel_values_on(torch.device("cuda")).cpu(), image.pixel_values)
