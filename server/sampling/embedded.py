"""The embedded sampling engine: HF transformers in this process, continuous batching with a KV cache.

One engine thread owns its copy of the base model: it moves arrivals into the line, admits the samples
that fit (embedded_requests.py), prefills them into the running batch and decodes a step (embedded_batch.py).
Like vLLM it takes the sampling renderer's collapsed prompt (one image pad per image, plus the images) and
expands the pads itself. Knows nothing about HTTP, the wire format or files.
"""

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from server.config import ModelConfig, SamplerConfig
from server.errors import EngineUnavailable
from server.lora.layers import apply_lora_wrappers
from server.models.loading import load_base_model
from server.models.vision_features import VisionEncoder
from server.sampling.adapters import SamplerAdapters
from server.sampling.decode_graphs import DecodeSettings
from server.sampling.embedded_batch import EngineModel, _Batch
from server.sampling.embedded_requests import _Active, _Line, _Waiting
from server.sampling.types import SampleOutput, SamplingRequest

logger = logging.getLogger(__name__)


def load_engine_model(config: ModelConfig, feature_cache_bytes: int) -> EngineModel:
    """A fresh copy of the base model (training shards its own copy, so sampling cannot share it)."""
    base = load_base_model(config)
    _, slot = apply_lora_wrappers(base.model, base.family)
    encoder = VisionEncoder(base.model, feature_cache_bytes) if base.vision is not None else None
    refused = base.vision.reserved_token_ids if base.vision is not None else frozenset()
    return EngineModel(base.model, slot, base.tokenizer, base.vision, encoder, refused, base.family.hybrid)


class EmbeddedEngine:
    """Continuous batching over one model copy, loaded by the engine thread on the first request."""

    def __init__(self, load: Callable[[], EngineModel], adapters: SamplerAdapters | None = None, *,
                 max_batch_tokens: int = 65536, prefix_cache_bytes: int = 0,
                 decode: DecodeSettings = DecodeSettings(), after_step: Callable[[], None] | None = None):
        """
        Args:
            load: builds the engine's model copy; called once, on the engine thread.
            adapters: where saved checkpoints' weights come from (requests that carry only a directory).
            max_batch_tokens: cache positions the batch may hold (rows times padded length, counted
                to where each row may end); a request's samples wait while they do not fit (part of
                them may join), except that a request alone in an empty batch always gets a row.
            prefix_cache_bytes: keys and values of earlier sequences kept for the prompts that start like
                them (prefix_cache.py); 0 keeps none.
            decode: how decode steps run (a static cache and CUDA graphs by default, for full-attention models).
            after_step: called on the engine thread after each pass of its loop (and after it fails requests),
                once the futures that pass completed are done: what they started may be sent on together.
        """
        self._load = load
        self.adapters = adapters
        self.max_batch_tokens = max_batch_tokens
        self.prefix_cache_bytes = prefix_cache_bytes
        self.decode = decode
        self._after_step = after_step or (lambda: None)
        self.batch: _Batch | None = None
        """The running batch, once the engine thread has loaded the model (read its counters, not its rows)."""
        self._waiting: queue.SimpleQueue[_Waiting | None] = queue.SimpleQueue()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-loader")
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @classmethod
    def on_demand(cls, model: ModelConfig, feature_cache_bytes: int, adapters: SamplerAdapters,
                  sampler: SamplerConfig, after_step: Callable[[], None] | None = None,
                  after_load: Callable[[], None] | None = None) -> "EmbeddedEngine":
        """An engine over its own copy of the base model: a server whose clients never use it never loads it.
        `after_load` runs on the engine thread once the model is loaded."""

        def load() -> EngineModel:
            loaded = load_engine_model(model, feature_cache_bytes)
            if after_load is not None:
                after_load()
            return loaded

        return cls(load, adapters,
                   max_batch_tokens=sampler.max_batch_tokens, prefix_cache_bytes=sampler.prefix_cache_bytes,
                   decode=DecodeSettings("graphs" if sampler.cuda_graphs else "static"), after_step=after_step)

    def submit(self, request: SamplingRequest) -> Future:
        """Queue one request for the running batch; its future completes when its last sample stops.

        Never waits: a saved adapter that is not loaded yet is read from disk by the loader thread,
        which queues the request once it is there.
        """
        waiting = _Waiting(request, None)
        adapter = request.adapter
        if adapter is None:
            self._queue(waiting)
        elif adapter.weights is not None or (cached := self.adapters.cached(adapter.directory)) is not None:
            waiting.adapter = adapter.weights or cached
            self._queue(waiting)
        else:
            self._loader.submit(self._load_then_queue, waiting)
        return waiting.future

    def _load_then_queue(self, waiting: "_Waiting") -> None:
        try:
            waiting.adapter = self.adapters.saved(waiting.request.adapter.directory)
            self._queue(waiting)
        except Exception as error:
            waiting.future.set_exception(error)

    def _queue(self, waiting: "_Waiting") -> None:
        with self._lock:
            if self._closed:
                raise EngineUnavailable("the embedded sampling engine is shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="embedded-sampler", daemon=True)
                self._thread.start()
            self._waiting.put(waiting)

    def on_engine_thread(self) -> bool:
        """Whether the caller is the engine thread (whose completions `after_step` follows)."""
        return threading.current_thread() is self._thread

    def sample(self, request: SamplingRequest) -> SampleOutput:
        """Sample one request in the running batch; blocks until its last sample stops."""
        return self.submit(request).result()

    def forget(self, adapter_name: str) -> None:
        """Nothing to release: adapters travel with their requests."""

    def close(self) -> None:
        self._loader.shutdown(wait=True)  # each load queues its request, which the close below fails
        with self._lock:
            self._closed = True
            thread = self._thread
        self._waiting.put(None)
        if thread is not None:
            thread.join()

    def _serve(self) -> None:
        """The engine thread: load the model, then admit, prefill and decode until closed."""
        try:
            batch = self.batch = _Batch(self._load(), self.max_batch_tokens, self.prefix_cache_bytes, self.decode)
        except Exception as error:
            logger.exception("the embedded sampling engine could not load its model")
            failure = EngineUnavailable(f"the embedded sampling engine could not load its model: {error}")
            while (waiting := self._waiting.get()) is not None:
                waiting.future.set_exception(failure)
                self._after_step()
            return
        line = _Line()
        while True:
            if not line and not batch.rows:
                waiting = self._waiting.get()  # idle: wait for work
                if waiting is None:
                    break
                line.arrive(_Active(waiting, batch.device))
            if self._take_arrivals(line, batch.device):
                break
            parts = line.admit(batch)
            if parts:
                batch.prefill(parts)
            if batch.rows:
                batch.decode_step()
            self._after_step()
        failure = EngineUnavailable("the server is shutting down")
        batch.fail_all(failure)
        line.fail_all(failure)
        while True:
            try:
                waiting = self._waiting.get_nowait()
            except queue.Empty:
                break
            if waiting is not None:
                waiting.future.set_exception(failure)
        self._after_step()

    def _take_arrivals(self, line: "_Line", device: torch.device) -> bool:
        """Move the requests that arrived into the line; whether the engine is closing."""
        while True:
            try:
                waiting = self._waiting.get_nowait()
            except queue.Empty:
                return False
            if waiting is None:
                return True
            line.arrive(_Active(waiting, device))
