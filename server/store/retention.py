"""Checkpoint retention: the TTL sweeper, and the pins that keep a checkpoint in use from being swept.

A checkpoint is in use, and never swept, while
- a sampling session of an unfinished session samples from it (the database knows this:
  `Store.expired_checkpoints`);
- a request of this process holds a pin on it: a sample request (from acceptance to its result), a
  load_weights (from acceptance until the weights are loaded), a save that writes its files, a
  copy_weights reading it.
Knows nothing about HTTP or engines; the caller says what else to release when a checkpoint goes.
"""

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from server.store.checkpoints import remove_checkpoint_files
from server.store.store import CheckpointRecord, Store

logger = logging.getLogger(__name__)


class CheckpointPins:
    """Checkpoints (by tinker path) that requests of this process are using; thread-safe."""

    def __init__(self):
        self._changed = threading.Condition()
        self._holds: Counter[str] = Counter()
        self._removing: set[str] = set()

    def acquire(self, tinker_path: str) -> None:
        """Pin a checkpoint (waiting out a removal already under way, after which it is simply gone)."""
        with self._changed:
            self._changed.wait_for(lambda: tinker_path not in self._removing)
            self._holds[tinker_path] += 1

    def try_acquire(self, tinker_path: str) -> bool:
        """Pin a checkpoint unless its removal is under way (False); never waits (safe on the event loop)."""
        with self._changed:
            if tinker_path in self._removing:
                return False
            self._holds[tinker_path] += 1
            return True

    def release(self, tinker_path: str) -> None:
        with self._changed:
            self._holds[tinker_path] -= 1
            if not self._holds[tinker_path]:
                del self._holds[tinker_path]

    @contextmanager
    def hold(self, tinker_path: str) -> Iterator[None]:
        self.acquire(tinker_path)
        try:
            yield
        finally:
            self.release(tinker_path)

    def remove_unless_pinned(self, tinker_path: str, remove: Callable[[], bool]) -> bool:
        """Run `remove` unless the checkpoint is pinned, keeping new pins out meanwhile; returns its result."""
        with self._changed:
            if self._holds[tinker_path]:
                return False
            self._removing.add(tinker_path)
        try:
            return remove()
        finally:
            with self._changed:
                self._removing.discard(tinker_path)
                self._changed.notify_all()


def sweep_expired_checkpoints(store: Store, pins: CheckpointPins, now: datetime, checkpoint_dir: Path,
                              on_removed: Callable[[CheckpointRecord], None]) -> list[str]:
    """Delete the rows and files of checkpoints whose TTL has passed and that are not in use.

    Args:
        on_removed: called for each removed checkpoint, to drop cached copies of its adapter.

    Returns: the tinker paths removed.
    """
    removed = []
    for record in store.expired_checkpoints(now):
        def remove(record: CheckpointRecord = record) -> bool:
            # The row goes first, in a statement that re-checks expiry and use, so nobody finds it half-deleted.
            if not store.delete_expired_checkpoint(record, now):
                return False
            remove_checkpoint_files(Path(record.directory), checkpoint_dir)
            return True

        if pins.remove_unless_pinned(record.tinker_path, remove):
            on_removed(record)
            removed.append(record.tinker_path)
    if removed:
        logger.info("deleted %d expired checkpoints: %s", len(removed), ", ".join(removed))
    return removed
