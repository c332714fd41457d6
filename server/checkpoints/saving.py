"""Saving a run's weights as a checkpoint: save_weights, save_weights_for_sampler (named) and
save_weights_external all take this one path.

The route plans the save when the request is accepted (`plan_save`: the name is checked, age recipients
parsed); the training thread takes a host copy of the adapter; `write_checkpoint` then writes the
files to a new version directory, on the checkpoint writer, and switches the journal's row to them
only once they are complete and on disk. The old version is deleted after that (see
server/store/checkpoints.py).
"""

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from server.checkpoints.lifecycle import Checkpoints
from server.errors import InvalidRequest
from server.lora.checkpoint_io import AdapterState, save_state
from server.progress import Progress
from server.runs import check_storage_quota
from server.store.checkpoints import TinkerPath, parse_tinker_path, remove_checkpoint_files, sync_directory_tree
from server.store.db import is_disk_full, storage_failure
from server.store.exports import encrypt_files, parse_age_recipients
from server.store.store import CheckpointRecord, TrainingRunRecord, utcnow

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedSave:
    """A save request, checked: where it goes and how it is written."""

    run: TrainingRunRecord
    tinker_path: TinkerPath
    overwrite: bool
    ttl_seconds: int | None
    user_metadata: dict[str, str] | None
    age_recipients: list | None
    """Encrypt the files to these (external weights), or None."""


def plan_save(run: TrainingRunRecord, segment: str, name: str, *, overwrite: bool, ttl_seconds: int | None,
              user_metadata: dict[str, str] | None = None, age_recipients: list[str] | None = None) -> PlannedSave:
    """Check a save request (its name, its age recipients) before it takes its turn."""
    tinker_path = TinkerPath(run.model_id, segment, name)
    parse_tinker_path(str(tinker_path))  # validates the name
    return PlannedSave(run, tinker_path, overwrite, ttl_seconds, user_metadata,
                       parse_age_recipients(age_recipients) if age_recipients else None)


def write_checkpoint(checkpoints: Checkpoints, save: PlannedSave, state: AdapterState) -> int:
    """Write the host copy `state` as the planned checkpoint and record it; returns its size. Pinned
    meanwhile, so that the TTL sweeper never removes a version being written."""
    with checkpoints.pins.hold(str(save.tinker_path)):
        return _write_and_record(checkpoints, save, state)


def _write_and_record(checkpoints: Checkpoints, save: PlannedSave, state: AdapterState) -> int:
    store, tinker_path, run = checkpoints.store, save.tinker_path, save.run
    existing = store.get_checkpoint(str(tinker_path))
    if existing is not None and not save.overwrite:
        raise InvalidRequest(f"checkpoint {tinker_path} already exists; choose another name")
    check_storage_quota(store, checkpoints.limits, run.owner)
    directory = tinker_path.new_version_directory(checkpoints.directory)
    started = time.perf_counter()
    try:
        with Progress("checkpoint_save", f"Saving {tinker_path}", logger, delay=2.0, tinker_path=tinker_path):
            size = save_state(directory, state)
            if save.age_recipients is not None:
                size = encrypt_files(directory, save.age_recipients)
            sync_directory_tree(directory)
        now = utcnow()
        store.add_checkpoint(CheckpointRecord(
            tinker_path=str(tinker_path), model_id=run.model_id, checkpoint_id=tinker_path.checkpoint_id,
            checkpoint_type=tinker_path.checkpoint_type, directory=str(directory), size_bytes=size,
            owner=run.owner, user_metadata=save.user_metadata or {}, created_at=now,
            expires_at=now + timedelta(seconds=save.ttl_seconds) if save.ttl_seconds else None))
    except Exception as error:
        remove_checkpoint_files(directory, checkpoints.directory)
        logger.warning("event=checkpoint_failed tinker_path=%s error=%r", tinker_path, type(error).__name__)
        if isinstance(error, OSError) or is_disk_full(error):
            raise storage_failure(error, f"save checkpoint {tinker_path}") from error
        raise
    if existing is not None:
        checkpoints.forget(existing)
        remove_checkpoint_files(Path(existing.directory), checkpoints.directory)
    logger.info("event=checkpoint_saved tinker_path=%s tenant=%s bytes=%d seconds=%.3f overwrote=%s", tinker_path,
                run.owner, size, time.perf_counter() - started, existing is not None)
    return size
