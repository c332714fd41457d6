"""The adapters sampling sessions sample with: ephemeral snapshots and saved sampler checkpoints.

Ephemeral snapshots (save_weights_and_get_sampling_client) live in memory, the newest few per
training run, and, when the sampling engine loads adapters by path (vLLM), also on disk in a
directory of their own. Saved adapters are loaded from their checkpoint directory on demand and
kept in a bounded LRU, so an evicted one is simply reloaded. Shared by the training thread (which
adds snapshots) and the sampling threads, hence the lock.
"""

import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from server.config import SamplerConfig
from server.errors import NotFound
from server.training.checkpoint_io import load_checkpoint, save_peft_adapter
from server.training.lora import LoraAdapter


@dataclass(frozen=True)
class Snapshot:
    model_id: str
    adapter: LoraAdapter
    directory: Path | None
    """Its PEFT files, when snapshots are written for an engine that loads adapters by path."""


class SamplerAdapters:
    def __init__(self, config: SamplerConfig, device: torch.device | str, snapshot_dir: Path | None = None,
                 on_forget: Callable[[str], None] | None = None):
        """
        Args:
            snapshot_dir: where snapshots are written (one new directory each); None keeps them in memory only.
            on_forget: called with a snapshot's sampling session id when it is dropped, so that an
                engine that loaded it can let it go.
        """
        self.config = config
        self.device = device
        self.snapshot_dir = snapshot_dir
        self.on_forget = on_forget
        self._lock = threading.Lock()
        self._ephemeral: OrderedDict[str, Snapshot] = OrderedDict()
        self._saved: OrderedDict[Path, LoraAdapter] = OrderedDict()

    def add_ephemeral(self, sampling_session_id: str, model_id: str, adapter: LoraAdapter, base_model: str) -> None:
        """Keep a snapshot; the oldest snapshots of the same run beyond the limit are dropped."""
        directory = None
        if self.snapshot_dir is not None:
            directory = self.snapshot_dir / sampling_session_id
            save_peft_adapter(directory, adapter, base_model)
        with self._lock:
            self._ephemeral[sampling_session_id] = Snapshot(model_id, adapter, directory)
            same_run = [sid for sid, snapshot in self._ephemeral.items() if snapshot.model_id == model_id]
            dropped = [(sid, self._ephemeral.pop(sid)) for sid in same_run[:-self.config.max_ephemeral_per_model]]
        self._release(dropped)

    def ephemeral(self, sampling_session_id: str) -> Snapshot:
        with self._lock:
            snapshot = self._ephemeral.get(sampling_session_id)
        if snapshot is None:
            raise NotFound(f"the weights of sampling session {sampling_session_id} are gone (only the newest "
                           f"{self.config.max_ephemeral_per_model} unsaved snapshots per run are kept, and none "
                           f"survive a restart); save them with save_weights_for_sampler(name) to keep them")
        return snapshot

    def forget_run(self, model_id: str) -> None:
        """Drop every unsaved snapshot of a training run."""
        with self._lock:
            dropped = [(sid, self._ephemeral.pop(sid)) for sid, snapshot in list(self._ephemeral.items())
                       if snapshot.model_id == model_id]
        self._release(dropped)

    def _release(self, dropped: list[tuple[str, Snapshot]]) -> None:
        for sampling_session_id, snapshot in dropped:
            if self.on_forget is not None:
                self.on_forget(sampling_session_id)
            if snapshot.directory is not None:
                shutil.rmtree(snapshot.directory, ignore_errors=True)

    def saved(self, directory: Path) -> LoraAdapter:
        """The adapter of a saved checkpoint, loaded on first use and kept while recently used."""
        with self._lock:
            adapter = self._saved.get(directory)
            if adapter is not None:
                self._saved.move_to_end(directory)
                return adapter
        if not directory.exists():
            raise NotFound(f"checkpoint files at {directory.name} are gone")
        adapter = load_checkpoint(directory, self.device, with_optimizer=False).adapter.frozen_copy()
        with self._lock:
            self._saved[directory] = adapter
            while len(self._saved) > self.config.max_loaded_adapters:
                self._saved.popitem(last=False)
        return adapter

    def forget(self, directory: Path) -> None:
        """Drop a deleted or overwritten checkpoint's cached adapter."""
        with self._lock:
            self._saved.pop(directory, None)
