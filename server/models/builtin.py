"""The models a server serves as `builtin:<name>`, and the cache they are built into on first use.

Each name maps to a builder that writes a complete HF model directory offline: the random tiny
members of each family (`tiny.py`) and SmolLM2-135M-Instruct, real weights converted from the
package that ships them (`smollm2.py`). Knows nothing about what is inside a model directory.

    python -m server.models.builtin smollm2-135m-instruct --cache-dir data/models
"""

import argparse
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from server.models import smollm2, tiny

Builder = Callable[[Path, Path], object]
"""Writes the model into its first argument; the second is the cache, for downloads and other built-ins."""

BUILTIN_MODELS: dict[str, Builder] = {
    **{name: (lambda out, cache, family=family: tiny.build_tiny_model(family, out))
       for name, family in tiny.BUILTIN_FAMILIES.items()},
    smollm2.TEXT_NAME: lambda out, cache: smollm2.build_text_model(out, cache / "downloads"),
    smollm2.VISION_NAME: lambda out, cache: smollm2.build_vision_model(
        out, ensure_builtin_model(smollm2.TEXT_NAME, cache)),
}


def ensure_builtin_model(name: str, cache_dir: Path) -> Path:
    """Return cache_dir/<name>, building the built-in model there on first use."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; known: {', '.join(BUILTIN_MODELS)}")
    cache_dir = Path(cache_dir)
    target = cache_dir / name
    # The directory only ever appears by an atomic rename, so if it exists it is complete.
    if target.is_dir():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_dir))
    try:
        BUILTIN_MODELS[name](staging, cache_dir)
        staging.rename(target)
    except OSError:
        # A concurrent build renamed its copy into place first; theirs is identical.
        if not target.is_dir():
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
