"""tinker:// checkpoint paths and where their files live on disk.

A path is `tinker://{model_id}/{weights|sampler_weights|external_weights}/{name}`, exactly as the SDK parses it
(three '/'-separated parts, so neither the run id nor the name may contain '/'). Files live
under `{checkpoint_dir}/{model_id}/{segment}/{name}/`.
"""

import re
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

    def directory(self, checkpoint_dir: Path) -> Path:
        return checkpoint_dir / self.model_id / self.segment / self.name


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
