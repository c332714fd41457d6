"""The adapters sampling sessions sample with: ephemeral snapshots and saved sampler checkpoints.

Shared by the training thread (which adds snapshots), the event loop (which pins them to requests) and
the engine's adapter loader, hence the lock. Knows nothing about HTTP or the store.
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
from server.lora.checkpoint_io import load_checkpoint, save_peft_adapter
from server.lora.layers import LoraAdapter


@dataclass(frozen=True)
class Snapshot:
    name: str
    """The sampling session id of the save that took it: one name per version of the weights."""
    model_id: str
    adapter: LoraAdapter | None
    """The weights in memory, when snapshots are not written (the embedded engine samples them as they are)."""
    directory: Path | None
    """Its PEFT files, when snapshots are written for an engine that loads adapters by path (vLLM): then the
    files are the snapshot, and the embedded engine beside vLLM loads them like a saved checkpoint's (a bounded
    cache). A copy in memory too would hold max_ephemeral_per_model adapters per run on the training GPU: 40 GB
    for a 30B MoE's experts' adapter."""


class SamplerAdapters:
    """Ephemeral snapshots (save_weights_and_get_sampling_client), the newest few per training run, live in
    memory, or, when the sampling engine loads adapters by path (vLLM), on disk instead, in a directory of
    their own (read like a saved checkpoint's by the embedded engine beside vLLM). A snapshot session samples its own snapshot; an inflight session
    (kind="inflight") samples its run's newest inflight snapshot, so every inflight save moves all the
    run's inflight sessions forward, and never back. Saved adapters are loaded from their checkpoint
    directory on demand and kept in a bounded LRU, so an evicted one is simply reloaded."""

    def __init__(self, config: SamplerConfig, device: torch.device | str, snapshot_dir: Path | None = None,
                 on_forget: Callable[[str], None] | None = None, snapshot_dtype: torch.dtype | None = None):
        """
        Args:
            snapshot_dir: where snapshots are written (one new directory each); None keeps them in memory only.
            snapshot_dtype: the dtype snapshots are written in (None: as trained). vLLM casts an adapter to its
                model's dtype as it loads it, so a bfloat16 vLLM gets the same weights from half the bytes: a
                MoE's routed-experts adapter is gigabytes, written and read at every RL step.
            on_forget: called with a snapshot's sampling session id when it is dropped, so that an
                engine that loaded it can let it go.
        """
        self.config = config
        self.device = device
        self.snapshot_dir = snapshot_dir
        self.snapshot_dtype = snapshot_dtype
        self.on_forget = on_forget
        self._lock = threading.Lock()
        self._ephemeral: OrderedDict[str, Snapshot] = OrderedDict()
        self._inflight_sessions: dict[str, str] = {}
        """Inflight sampling session id -> the training run whose newest inflight snapshot it samples."""
        self._newest_inflight: dict[str, str] = {}
        """Training run -> the name of its newest inflight snapshot (never dropped while it is)."""
        self._saved: OrderedDict[Path, LoraAdapter] = OrderedDict()

    def add_ephemeral(self, sampling_session_id: str, model_id: str, adapter: LoraAdapter, base_model: str, *,
                      inflight: bool = False) -> None:
        """Keep a snapshot (inflight: also make it what every inflight session of the run samples), in memory or,
        with a snapshot_dir, as files only; the oldest snapshots of the same run beyond the limit are dropped,
        never the run's newest inflight one."""
        directory = None
        if self.snapshot_dir is not None:
            directory = self.snapshot_dir / sampling_session_id
            save_peft_adapter(directory, adapter, base_model, dtype=self.snapshot_dtype)
            adapter = None
        with self._lock:
            self._ephemeral[sampling_session_id] = Snapshot(sampling_session_id, model_id, adapter, directory)
            if inflight:
                self._inflight_sessions[sampling_session_id] = model_id
                self._newest_inflight[model_id] = sampling_session_id
            same_run = [sid for sid, snapshot in self._ephemeral.items() if snapshot.model_id == model_id]
            droppable = [sid for sid in same_run if sid != self._newest_inflight.get(model_id)]
            excess = len(same_run) - self.config.max_ephemeral_per_model
            dropped = [(sid, self._ephemeral.pop(sid)) for sid in droppable[:max(0, excess)]]
        self._release(dropped)

    def ephemeral(self, sampling_session_id: str) -> Snapshot:
        """The snapshot a session samples now: its own, or for an inflight session its run's newest inflight one."""
        with self._lock:
            model_id = self._inflight_sessions.get(sampling_session_id)
            name = sampling_session_id if model_id is None else self._newest_inflight[model_id]
            snapshot = self._ephemeral.get(name)
        if snapshot is None:
            raise NotFound(f"the weights of sampling session {sampling_session_id} are gone (only the newest "
                           f"{self.config.max_ephemeral_per_model} unsaved snapshots per run are kept, while the "
                           f"run is loaded, and none survive a restart); save them with "
                           f"save_weights_for_sampler(name) to keep them")
        return snapshot

    def forget_run(self, model_id: str) -> None:
        """Drop every unsaved snapshot of a training run (its inflight sessions then have no weights)."""
        with self._lock:
            dropped = [(sid, self._ephemeral.pop(sid)) for sid, snapshot in list(self._ephemeral.items())
                       if snapshot.model_id == model_id]
            self._newest_inflight.pop(model_id, None)
            self._inflight_sessions = {sid: run for sid, run in self._inflight_sessions.items() if run != model_id}
        self._release(dropped)

    def _release(self, dropped: list[tuple[str, Snapshot]]) -> None:
        for sampling_session_id, snapshot in dropped:
            if self.on_forget is not None:
                self.on_forget(sampling_session_id)
            if snapshot.directory is not None:
                self.forget(snapshot.directory)
                shutil.rmtree(snapshot.directory, ignore_errors=True)

    def cached(self, directory: Path) -> LoraAdapter | None:
        """The adapter of a saved checkpoint if it is loaded already (never reads the disk)."""
        with self._lock:
            adapter = self._saved.get(directory)
            if adapter is not None:
                self._saved.move_to_end(directory)
            return adapter

    def saved(self, directory: Path) -> LoraAdapter:
        """The adapter of a saved checkpoint (or of a snapshot's files), loaded on first use and kept while
        recently used."""
        adapter = self.cached(directory)
        if adapter is not None:
            return adapter
        if not directory.exists():
            raise NotFound(f"checkpoint files at {directory.name} are gone")
        adapter = load_checkpoint(directory, self.device, with_optimizer=False).adapter.frozen_copy()
        adapter.check_finite("the checkpoint's weights")  # one saved before optim_step refused to make them
        with self._lock:
            self._saved[directory] = adapter
            while len(self._saved) > self.config.max_loaded_adapters:
                self._saved.popitem(last=False)
        return adapter

    def forget(self, directory: Path) -> None:
        """Drop a deleted or overwritten checkpoint's (or a dropped snapshot's) cached adapter."""
        with self._lock:
            self._saved.pop(directory, None)
