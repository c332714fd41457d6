"""A saved checkpoint's life after its save: publishing, its TTL, deletion, and the sweep of expired ones."""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from server.config import LimitsConfig
from server.errors import Conflict
from server.store.checkpoints import remove_checkpoint_files
from server.store.retention import CheckpointPins, sweep_expired_checkpoints
from server.store.store import CheckpointRecord, Store, utcnow


@dataclass(frozen=True)
class Checkpoints:
    """What the checkpoint lifecycle works with."""

    store: Store
    directory: Path
    """Where checkpoint files live (one version directory per save)."""
    pins: CheckpointPins
    """Checkpoints that requests are loading, writing or copying: never swept meanwhile."""
    limits: LimitsConfig
    forget: Callable[[CheckpointRecord], None]
    """Releases every cached copy of a deleted or overwritten checkpoint's adapter (the samplers')."""


def delete_checkpoint(checkpoints: Checkpoints, record: CheckpointRecord) -> None:
    """Delete a checkpoint's row, its cached adapters and its files."""
    checkpoints.store.delete_checkpoint(record.tinker_path)
    checkpoints.forget(record)
    remove_checkpoint_files(Path(record.directory), checkpoints.directory)


def set_public(store: Store, record: CheckpointRecord, public: bool) -> None:
    """Publish (every tenant may read it) or unpublish a checkpoint; 409 if it already is so."""
    if record.public == public:
        raise Conflict(f"checkpoint {record.tinker_path} is already {'public' if public else 'private'}")
    store.set_checkpoint_public(record.tinker_path, public)


def set_ttl(store: Store, record: CheckpointRecord, ttl_seconds: int | None) -> None:
    """Expire a checkpoint ttl_seconds from now, or never (None)."""
    expires_at = utcnow() + timedelta(seconds=ttl_seconds) if ttl_seconds is not None else None
    store.set_checkpoint_expires_at(record.tinker_path, expires_at)


def sweep_expired(checkpoints: Checkpoints, now: datetime) -> list[str]:
    """Delete expired checkpoints that are not in use; returns their paths."""
    return sweep_expired_checkpoints(checkpoints.store, checkpoints.pins, now, checkpoints.directory,
                                     checkpoints.forget)
