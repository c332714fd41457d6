"""Offline stand-ins for the hub datasets that cookbook recipes load, written in the hub's own layout.

`datasets.load_dataset("<org>/<name>")` reads a relative directory of that name before it asks the
hub, so a recipe started in a directory that holds these loads them with HF_DATASETS_OFFLINE=1 and
no change to its code. Knows nothing about the server or the recipes' training loops.

    python tests/integration/cookbook_data.py DIR   # writes DIR/Anthropic/hh-rlhf and DIR/dpdl-benchmark/caltech101

`write_chit_chat` is not made up: it puts real conversations (the Chit-Chat Challenge corpus of the
`chitchat-dataset` package, MIT) where the cookbook's chat recipes look for NoRobots.
"""

import io
import random
import sys
from pathlib import Path

import datasets
from PIL import Image, ImageDraw

HH_RLHF = "Anthropic/hh-rlhf"
CALTECH101 = "dpdl-benchmark/caltech101"
NO_ROBOTS = "HuggingFaceH4/no_robots"

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


def write_chit_chat(root: Path, num_train: int, num_test: int, seed: int = 0) -> Path:
    """Write `root/HuggingFaceH4/no_robots/data/{train,test}-*.parquet` (a `messages` column, as NoRobots
    has) with real human-to-human chats: the first speaker of each is the user, the other the assistant.

    7,168 conversations of students chatting freely (BYU's Chit-Chat Challenge, 2018); a seeded choice
    of disjoint train and test conversations.
    """
    import chitchat_dataset

    corpus = chitchat_dataset.Dataset()
    # Some chats never got going: keep those with at least two turns from each side.
    chats = [messages for _, messages in sorted((key, _chat_messages(value["messages"])) for key, value in corpus.items())
             if len(messages) >= 4]
    chosen = random.Random(seed).sample(chats, num_train + num_test)
    out = root / NO_ROBOTS / "data"
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", chosen[:num_train]), ("test", chosen[num_train:])):
        datasets.Dataset.from_list([{"messages": messages} for messages in rows]).to_parquet(
            str(out / f"{split}-00000-of-00001.parquet"))
    return root / NO_ROBOTS


def _chat_messages(turns: list[list[dict]]) -> list[dict[str, str]]:
    """One message per turn (a turn is a run of lines by one sender), roles by who spoke first."""
    first_sender = turns[0][0]["sender"]
    messages: list[dict[str, str]] = []
    for turn in turns:
        role = "user" if turn[0]["sender"] == first_sender else "assistant"
        text = "\n".join(line["text"].strip() for line in turn)
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n" + text
        else:
            messages.append({"role": role, "content": text})
    return messages


if __name__ == "__main__":
    target = Path(sys.argv[1])
    print(write_hh_rlhf(target))
    print(write_caltech101(target))
    print(write_chit_chat(target, num_train=512, num_test=32))
