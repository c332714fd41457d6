"""tinker:// checkpoint paths and where their files live on disk.

A path is `tinker://{model_id}/{weights|sampler_weights|external_weights}/{name}`, exactly as the SDK parses it
(three '/'-separated parts, so neither the run id nor the name may contain '/'). Each save writes
a new version directory `{checkpoint_dir}/{model_id}/{segment}/{name}/v-{random}/`, and the
checkpoint's row in the journal points at it; the row is switched only once the files are complete,
and the old version is deleted after that. An overwrite interrupted anywhere (kill -9, full disk)
therefore leaves the old checkpoint or the new one listed, never half of one; the files of a
version no row points at are leftovers, swept at start-up.
"""

import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from server.errors import InvalidRequest

SCHEME = "tinker://"
CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
_NAME = re.compile(r"^[A-Za-z0-9_.:=+-]{1,200}$")


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    segment: str
    """weights | sampler_weights | external_weights"""
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        return CHECKPOINT_TYPES[self.segment]

    def __str__(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.segment}/{self.name}"

    def new_version_directory(self, checkpoint_dir: Path) -> Path:
        """A fresh directory for the next save of this checkpoint (not created yet)."""
        return checkpoint_dir / self.model_id / self.segment / self.name / f"v-{secrets.token_hex(6)}"


def sync_directory_tree(directory: Path) -> None:
    """Flush a written checkpoint's files and directory entries to disk before the journal points at it."""
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())
        descriptor = os.open(root, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def remove_checkpoint_files(directory: Path, checkpoint_dir: Path) -> None:
    """Delete one version's files, and the checkpoint's folders above it that are left empty."""
    shutil.rmtree(directory, ignore_errors=True)
    parent = directory.parent
    while parent != checkpoint_dir and checkpoint_dir in parent.parents:
        try:
            parent.rmdir()
        except OSError:  # not empty (another version, or another checkpoint of the run)
            return
        parent = parent.parent


def sweep_unlisted_versions(checkpoint_dir: Path, listed_directories: set[str]) -> int:
    """Delete version directories no checkpoint row points at (a save that a crash cut short, or an old
    version whose deletion it interrupted); returns how many. Run at start-up, before any save."""
    swept = 0
    for version in checkpoint_dir.glob("*/*/*/v-*"):
        name_directory = version.parent
        listed = str(version) in listed_directories or str(name_directory) in listed_directories
        if version.is_dir() and not listed:
            remove_checkpoint_files(version, checkpoint_dir)
            swept += 1
    return swept


def validate_checkpoint_name(name: str) -> str:
    """A checkpoint name that is safe as a path component and in a tinker:// path."""
    if not _NAME.match(name) or name in (".", ".."):
        raise InvalidRequest(f"checkpoint name {name!r} must be 1-200 characters of letters, digits and _.:=+- "
                             f"(no '/')")
    return name


def parse_tinker_path(path: str) -> TinkerPath:
    """Split a tinker:// path; anything else is a 400 that shows the expected form."""
    parts = path[len(SCHEME):].split("/") if path.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] not in CHECKPOINT_TYPES or not parts[0]:
        raise InvalidRequest(f"{path!r} is not a checkpoint path: expected "
                             f"tinker://MODEL_ID/{{weights,sampler_weights,external_weights}}/NAME")
    return TinkerPath(parts[0], parts[1], validate_checkpoint_name(parts[2]))
