"""The adapters sampling sessions sample with: ephemeral snapshots and saved sampler checkpoints.

Ephemeral snapshots (save_weights_and_get_sampling_client) live in memory, the newest few per
training run; saved adapters are loaded from their checkpoint directory on demand and kept in a
bounded LRU, so an evicted one is simply reloaded. Shared by the training thread (which adds
snapshots) and the sampling thread, hence the lock.
"""

import threading
from collections import OrderedDict
from pathlib import Path

import torch

from server.config import SamplerConfig
from server.errors import NotFound
from server.training.checkpoint_io import load_checkpoint
from server.training.lora import LoraAdapter


class SamplerAdapters:
    def __init__(self, config: SamplerConfig, device: torch.device | str):
        self.config = config
        self.device = device
        self._lock = threading.Lock()
        self._ephemeral: OrderedDict[str, tuple[str, LoraAdapter]] = OrderedDict()
        self._saved: OrderedDict[Path, LoraAdapter] = OrderedDict()

    def add_ephemeral(self, sampling_session_id: str, model_id: str, adapter: LoraAdapter) -> None:
        """Keep a snapshot; the oldest snapshots of the same run beyond the limit are dropped."""
        with self._lock:
            self._ephemeral[sampling_session_id] = (model_id, adapter)
            same_run = [sid for sid, (mid, _) in self._ephemeral.items() if mid == model_id]
            for sid in same_run[:-self.config.max_ephemeral_per_model]:
                del self._ephemeral[sid]

    def ephemeral(self, sampling_session_id: str) -> LoraAdapter:
        with self._lock:
            entry = self._ephemeral.get(sampling_session_id)
        if entry is None:
            raise NotFound(f"the weights of sampling session {sampling_session_id} are gone (only the newest "
                           f"{self.config.max_ephemeral_per_model} unsaved snapshots per run are kept, and none "
                           f"survive a restart); save them with save_weights_for_sampler(name) to keep them")
        return entry[1]

    def forget_run(self, model_id: str) -> None:
        """Drop every unsaved snapshot of a training run."""
        with self._lock:
            for sid in [sid for sid, (mid, _) in self._ephemeral.items() if mid == model_id]:
                del self._ephemeral[sid]

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
