"""Images of a prompt: decode within limits, convert to RGB, resize and patchify as the model's processor does.

Owns the one preprocessing that training and sampling share: `ImagePreparer.prepare(bytes)` gives a
`PreparedImage` (resized RGB pixels, the patch grid, the number of image tokens and `pixel_values`),
cached by content hash so an image repeated across a batch, across samples or across steps is
decoded once. The arithmetic is the Qwen2-VL image processor's (smart_resize, patches, merge), read
from the model's own preprocessor_config.json. Knows nothing about tokens, models or engines.

Shapes: C = 3 colour channels, H/W = pixels after resizing, P = patches (grid_t * grid_h * grid_w).
"""

import hashlib
import io
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

from server.config import ImageConfig
from server.errors import InvalidRequest
from server.models.image_processor import ImageProcessorSpec, PreparedImage

_DECODABLE_FORMATS = ["PNG", "JPEG"]

def decode_rgb(data: bytes, config: ImageConfig, where: str) -> np.ndarray:
    """Decode PNG/JPEG bytes to uint8 RGB [H, W, C] within the byte and pixel limits.

    Transparency is composited onto white (as the Qwen-VL processors do); 16-bit images are scaled
    to 8 bits rather than clipped. EXIF orientation is ignored, as by the client's token count.
    """
    if len(data) > config.max_image_bytes:
        raise InvalidRequest(f"{where}: image of {len(data)} bytes is over the limit of {config.max_image_bytes} "
                             f"bytes (max_image_bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=_DECODABLE_FORMATS)
    except Image.DecompressionBombError as error:  # PIL's own header check, for sizes far past ours
        raise InvalidRequest(f"{where}: image is over the limit of {config.max_image_pixels} pixels "
                             f"(max_image_pixels): {error}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise InvalidRequest(f"{where}: image data could not be decoded as PNG or JPEG ({error})") from None
    width, height = image.size  # read from the header: no pixel is decoded yet
    if width * height > config.max_image_pixels:
        raise InvalidRequest(f"{where}: image of {width}x{height} pixels is over the limit of "
                             f"{config.max_image_pixels} pixels (max_image_pixels)")
    if width == 0 or height == 0:
        raise InvalidRequest(f"{where}: image has no pixels ({width}x{height})")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as error:
        raise InvalidRequest(f"{where}: image data could not be decoded ({error})") from None
    return _to_rgb(image)


def _to_rgb(image: Image.Image) -> np.ndarray:
    if image.mode.startswith("I"):
        # 16-bit grey (I;16*, or I from older decoders): keep the top 8 bits instead of PIL's clipping at 255.
        values = np.clip(np.asarray(image, dtype=np.int64), 0, 0xFFFF)
        return np.repeat((values >> 8).astype(np.uint8)[:, :, None], 3, axis=2)
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(background, rgba).convert("RGB"))
    # convert() copies even an RGB image (0.5 ms of a 448x448 JPEG's 2 ms on the CPU box).
    return np.array(image if image.mode == "RGB" else image.convert("RGB"))


def preprocess(rgb: np.ndarray, spec: ImageProcessorSpec, sha256: str) -> PreparedImage:
    """Resize as the processor's torchvision backend does on CPU: bicubic, antialiased, in uint8."""
    height, width = rgb.shape[:2]
    resized_height, resized_width = spec.resized_size(height, width)
    # Channels first by numpy: images are prepared on several threads at once, and torch's copy would start a
    # team of OpenMP threads (as many as the rank's share of the cores) from each.
    pixels = torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1)))
    if (resized_height, resized_width) != (height, width):
        pixels = F.interpolate(pixels[None], size=(resized_height, resized_width), mode="bicubic",
                               antialias=True, align_corners=False)[0]
    p, m = spec.patch_size, spec.merge_size
    grid_h, grid_w = resized_height // p, resized_width // p
    return PreparedImage(sha256=sha256, pixels=pixels, grid_thw=(1, grid_h, grid_w),
                         num_tokens=grid_h * grid_w // (m * m), processor=spec)


class ImagePreparer:
    """Decodes and preprocesses images once per content hash, in a byte-bounded LRU shared by all requests."""

    def __init__(self, spec: ImageProcessorSpec, config: ImageConfig, host_pixel_values: bool = True):
        """`host_pixel_values`: whether the images' pixel values are derived on the host (a CPU device): on a
        GPU they never are, and a cache that counted them would hold a fifth of the images it can."""
        self.spec = spec
        self.config = config
        self.host_pixel_values = host_pixel_values
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, PreparedImage] = OrderedDict()
        self._cached_bytes = 0
        self._workers: ThreadPoolExecutor | None = None

    def prepare_all(self, images: list[tuple[bytes, str]]) -> None:
        """Prepare these images side by side, so that a request of many new images waits about as long as its
        slowest one rather than their sum (PIL's decoders and torch's resize release the interpreter lock); its
        rendering then finds them cached. An image that cannot be prepared is left for that rendering to
        refuse, in the request's order."""
        distinct = list({data: where for data, where in images}.items())  # a repeated image once
        if len(distinct) < 2:
            return
        with self._lock:  # requests prepared at once share one pool
            if self._workers is None:  # as many threads as torch's (a training rank's share of the host's cores)
                self._workers = ThreadPoolExecutor(max_workers=max(1, min(8, torch.get_num_threads())),
                                                   thread_name_prefix="image-prepare")
        for future in [self._workers.submit(self.prepare, data, where) for data, where in distinct]:
            try:
                future.result()
            except InvalidRequest:
                pass

    def prepare(self, data: bytes, where: str) -> PreparedImage:
        """The prepared image of these encoded bytes (a 400 naming `where` if they are not a valid image)."""
        sha256 = hashlib.sha256(data).hexdigest()
        with self._lock:
            image = self._cache.get(sha256)
            if image is not None:
                self._cache.move_to_end(sha256)
                return image
        image = preprocess(decode_rgb(data, self.config, where), self.spec, sha256)
        with self._lock:
            if sha256 not in self._cache:
                self._cache[sha256] = image
                self._cached_bytes += image.held_bytes(self.host_pixel_values)
            while self._cached_bytes > self.config.decoded_cache_bytes and len(self._cache) > 1:
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.held_bytes(self.host_pixel_values)
        return image

    def read_asset(self, location: str, where: str) -> bytes:
        """The bytes of an image_asset_pointer: a local file under the configured image root, nothing else."""
        root = self.config.image_root
        if root is None:
            raise InvalidRequest(f"{where}: image_asset_pointer chunks are not enabled on this server (start it "
                                 f"with --image-root DIR to serve images from a local directory)")
        if "://" in location and not location.startswith("file://"):
            raise InvalidRequest(f"{where}: image_asset_pointer location {location!r} is not a local file; only "
                                 f"paths (or file:// URLs) under the server's image root are accepted")
        path = Path(location.removeprefix("file://"))
        resolved = (root / path).resolve() if not path.is_absolute() else path.resolve()
        if not resolved.is_relative_to(root.resolve()):
            raise InvalidRequest(f"{where}: image_asset_pointer {location!r} is outside the server's image root")
        if not resolved.is_file():
            raise InvalidRequest(f"{where}: image_asset_pointer {location!r} does not exist")
        if resolved.stat().st_size > self.config.max_image_bytes:
            raise InvalidRequest(f"{where}: image of {resolved.stat().st_size} bytes is over the limit of "
                                 f"{self.config.max_image_bytes} bytes (max_image_bytes)")
        return resolved.read_bytes()
