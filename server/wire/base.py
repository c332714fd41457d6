"""What every Tinker wire type shares: the bounds on what a client may send and the two base classes.

Names and fields follow the `tinker` SDK 0.38 so that the same words run from route to trainer.
Requests ignore unknown fields; responses leave out fields that are None, because the SDK
validates responses strictly and expects omission. Shapes only: the wire modules know nothing of
what any route, scheduler or engine does with them; the protobuf codec lives in `proto.py`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_serializer


# Bounds on the numbers a client sends: past them a value is a mistake (or an attack), and refusing
# it here gives a 400 that names the field instead of an overflow deep in the database or engine.
MAX_INT32 = 2**31 - 1
MAX_SEQ_ID = 2**63 - 1
"""Sampling clones number requests clone_id * 1e9 + k (clone_id up to 1e9), past 32 bits."""
MAX_ID_LENGTH = 512
MAX_LOGPROB_WIDTH = 1024
"""Most (token, logprob) pairs a sampling request may ask for per position: top-k widths,
prompt_alt_tokens_k, and target_prompt_logprobs' ids per position."""
MIN_TTL_SECONDS, MAX_TTL_SECONDS = 3600, 10 * 366 * 24 * 3600

SeqId = Annotated[int, Field(ge=1, le=MAX_SEQ_ID)]
"""A training request's place in its model's order (the SDK counts from 1; 0 is the model's creation)."""
SampleSeqId = Annotated[int, Field(ge=0, le=MAX_SEQ_ID)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
Int32 = Annotated[int, Field(ge=0, le=MAX_INT32)]
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]
TtlSeconds = Annotated[int, Field(ge=MIN_TTL_SECONDS, le=MAX_TTL_SECONDS)]
"""A checkpoint's time to live: 1 hour to 10 years, as the SDK documents (None: it never expires)."""

# Free-form text the journal keeps (names, tags, metadata), bounded so that no key holder can fill the
# disk or the answers of sessions/search through it; each refusal is a 400 that names the field.
MAX_NAME_LENGTH = 4096
"""Display names, project ids, tags, loss names, SDK versions (the cookbook names a session by its log path)."""
MAX_CHECKPOINT_NAME_LENGTH = 255
"""A checkpoint's name is a directory's name."""
MAX_LIST_LENGTH = 64
"""Tags of a session, project ids of a search, age recipients."""
MAX_METADATA_KEYS = 64
MAX_METADATA_BYTES = 16 * 1024
"""user_metadata as JSON (sessions, runs, checkpoints)."""
Name = Annotated[str, Field(max_length=MAX_NAME_LENGTH)]


def _bounded_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if len(value) > MAX_METADATA_KEYS:
        raise ValueError(f"user_metadata has {len(value)} keys, over the limit of {MAX_METADATA_KEYS}")
    size = len(json.dumps(value, default=str))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"user_metadata is {size} bytes as JSON, over the limit of {MAX_METADATA_BYTES}")
    return value


UserMetadata = Annotated[dict[str, Any] | None, AfterValidator(_bounded_metadata)]
StringMetadata = Annotated[dict[str, str] | None, AfterValidator(_bounded_metadata)]


def _reject_nul(value: Any) -> Any:
    # PostgreSQL cannot store NUL in text, and no name, id or path needs one.
    if isinstance(value, str):
        strings: Any = (value,)
    elif isinstance(value, dict):
        strings = [s for pair in value.items() for s in pair if isinstance(s, str)]
    elif isinstance(value, list) and value and isinstance(value[0], str):
        strings = value
    else:
        return value
    if any("\x00" in s for s in strings if isinstance(s, str)):
        raise ValueError("text fields may not contain NUL characters")
    return value


class WireRequest(BaseModel):
    """Base of request bodies: unknown fields are ignored, so newer SDKs keep working. Floats must
    be finite, and no text field may hold a NUL character."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul_in_text(cls, value: Any) -> Any:
        return _reject_nul(value)


class WireResponse(BaseModel):
    """Base of response bodies: None fields are omitted, which every SDK response model accepts."""

    model_config = ConfigDict(protected_namespaces=())

    # Unannotated on purpose: pydantic then keeps each model's own schema for OpenAPI.
    @model_serializer(mode="wrap")
    def _omit_none(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}
