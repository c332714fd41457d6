"""Wire types of the REST listings: checkpoints and training runs, a page at a time."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from server.wire.base import WireResponse


class Checkpoint(WireResponse):
    checkpoint_id: str
    """Segment and name, e.g. "weights/step-100"."""
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


class Cursor(WireResponse):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(WireResponse):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(WireResponse):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(WireResponse):
    training_runs: list[TrainingRun]
    cursor: Cursor
