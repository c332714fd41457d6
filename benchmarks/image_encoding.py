"""What the PNG an image prompt is sent to vLLM as costs (`PreparedImage.png_bytes`), by zlib level.

    python benchmarks/image_encoding.py [--sizes 112,448,896] [--repeats 10]

With `--sampler vllm`, every new image of a prompt is encoded once as a lossless PNG of its resized pixels
(vLLM decodes it back exactly), on the server's host. Two kinds of content: smooth (a coarse random grid,
bicubically enlarged: how photos and rendered scenes compress) and noise (incompressible). For each size,
kind and level it prints milliseconds to encode and to decode, and the PNG's size; levels 0 (stored), 1
(fastest deflate) and 6 (Pillow's default).
"""

import argparse
import io
import time

import numpy as np
from PIL import Image

LEVELS = (6, 1, 0)


def images(size: int, seed: int = 0) -> dict[str, Image.Image]:
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (max(1, size // 32),) * 2 + (3,), dtype=np.uint8))
    return {"smooth": coarse.resize((size, size), Image.BICUBIC),
            "noise": Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))}


def timed(action, repeats: int) -> float:
    """Median milliseconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def encoded(image: Image.Image, level: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=level)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="112,448,896")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print("| size | content | zlib level | encode ms | decode ms | PNG KiB |")
    print("|---|---|---|---|---|---|")
    for size in (int(size) for size in args.sizes.split(",")):
        for kind, image in images(size).items():
            for level in LEVELS:
                data = encoded(image, level)
                encode = timed(lambda: encoded(image, level), args.repeats)
                decode = timed(lambda: Image.open(io.BytesIO(data)).load(), args.repeats)
                print(f"| {size} | {kind} | {level} | {encode:.2f} | {decode:.2f} | {len(data) // 1024} |")


if __name__ == "__main__":
    main()
