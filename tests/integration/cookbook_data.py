"""Offline stand-ins for the hub datasets that cookbook recipes load, written in the hub's own layout.

`datasets.load_dataset("<org>/<name>")` reads a relative directory of that name before it asks the
hub, so a recipe started in a directory that holds these loads them with HF_DATASETS_OFFLINE=1 and
no change to its code. Knows nothing about the server or the recipes' training loops.

    python tests/integration/cookbook_data.py DIR   # writes DIR/Anthropic/hh-rlhf and DIR/dpdl-benchmark/caltech101
"""

import io
import random
import sys
from pathlib import Path

import datasets
from PIL import Image, ImageDraw

HH_RLHF = "Anthropic/hh-rlhf"
CALTECH101 = "dpdl-benchmark/caltech101"

_COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
_THINGS = ["apple", "car", "house", "ball", "cup", "book", "bird", "hat"]

# Class names keep Caltech-101's spelling habits (underscores, capitals, a dot), which the recipe
# cleans into "red circle", "faces easy", "blue triangle"...
CALTECH_CLASSES = ["red_circle", "Faces_easy", "blue.triangle", "gray_cross"]
# Caltech-101 holds grayscale (mode L) images, which the cookbook sends as grayscale JPEGs.
_GRAYSCALE_CLASSES = {"gray_cross"}
# Sizes below and above the recipe's 480-pixel cap, portrait and landscape.
_IMAGE_SIZES = [(96, 64), (64, 96), (80, 80), (600, 400)]


def _hh_rlhf_row(rng: random.Random) -> dict[str, str]:
    colour, thing = rng.choice(_COLOURS), rng.choice(_THINGS)
    prompt = f"\n\nHuman: What colour is the {thing}?\n\nAssistant:"
    # One consistent preference (a full answer over a curt one), so DPO has something to learn.
    return {"chosen": f"{prompt} The {thing} is {colour}.", "rejected": f"{prompt} no"}


def write_hh_rlhf(root: Path, num_train: int = 32, num_test: int = 8, seed: int = 0) -> Path:
    """Write `root/Anthropic/hh-rlhf/data/{train,test}-*.parquet` with hh-rlhf's chosen/rejected columns."""
    rng = random.Random(seed)
    out = root / HH_RLHF / "data"
    out.mkdir(parents=True, exist_ok=True)
    for split, size in (("train", num_train), ("test", num_test)):
        rows = [_hh_rlhf_row(rng) for _ in range(size)]
        datasets.Dataset.from_list(rows).to_parquet(str(out / f"{split}-00000-of-00001.parquet"))
    return root / HH_RLHF


def _shape_image(name: str, size: tuple[int, int], rng: random.Random) -> Image.Image:
    width, height = size
    image = Image.new("RGB", size, tuple(rng.randrange(200, 256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    side = min(width, height) * rng.uniform(0.5, 0.8)
    left, top = rng.uniform(0, width - side), rng.uniform(0, height - side)
    box = (left, top, left + side, top + side)
    if name == "red_circle":
        draw.ellipse(box, fill=(220, 30, 30))
    elif name == "Faces_easy":
        draw.ellipse(box, fill=(240, 200, 150))
        eye = side / 10
        for x in (left + side * 0.3, left + side * 0.7):
            draw.ellipse((x - eye, top + side * 0.35 - eye, x + eye, top + side * 0.35 + eye), fill=(0, 0, 0))
        draw.line((left + side * 0.3, top + side * 0.7, left + side * 0.7, top + side * 0.7), fill=(0, 0, 0), width=3)
    elif name == "blue.triangle":
        draw.polygon([(left + side / 2, top), (left, top + side), (left + side, top + side)], fill=(30, 30, 220))
    else:
        bar = side / 4
        draw.rectangle((left, top + (side - bar) / 2, left + side, top + (side + bar) / 2), fill=(60, 60, 60))
        draw.rectangle((left + (side - bar) / 2, top, left + (side + bar) / 2, top + side), fill=(60, 60, 60))
    return image.convert("L") if name in _GRAYSCALE_CLASSES else image


def _jpeg_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")
    return buffer.getvalue()


def write_caltech101(root: Path, num_train_per_class: int = 4, num_test_per_class: int = 2, seed: int = 0) -> Path:
    """Write `root/dpdl-benchmark/caltech101/data/{train,test}-*.parquet`: an `image` column (JPEG) and a
    `label` ClassLabel column with names, as the hub dataset has."""
    rng = random.Random(seed)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CALTECH_CLASSES)})
    out = root / CALTECH101 / "data"
    out.mkdir(parents=True, exist_ok=True)
    for split, per_class in (("train", num_train_per_class), ("test", num_test_per_class)):
        rows = [{"image": {"bytes": _jpeg_bytes(_shape_image(name, _IMAGE_SIZES[i % len(_IMAGE_SIZES)], rng)),
                           "path": None},
                 "label": label}
                for label, name in enumerate(CALTECH_CLASSES) for i in range(per_class)]
        rng.shuffle(rows)
        # Dataset.to_parquet stores the features in the file's metadata, so load_dataset gets the
        # ClassLabel names back (the recipe calls int2str on them).
        datasets.Dataset.from_list(rows, features=features).to_parquet(str(out / f"{split}-00000-of-00001.parquet"))
    return root / CALTECH101


if __name__ == "__main__":
    target = Path(sys.argv[1])
    print(write_hh_rlhf(target))
    print(write_caltech101(target))
