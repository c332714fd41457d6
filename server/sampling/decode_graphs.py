"""The embedded engine's decode forward over a bucket of the static cache (static_cache.py): eagerly, or on a
CUDA device by replaying the bucket's CUDA graph, captured the first time the bucket is needed.

A step of a small model is milliseconds of Python and kernel launches whatever the batch; a graph replays
them in one launch. A graph reads its inputs from the cache's buffers and the adapters from AdapterBuffers,
at the addresses they had when it was captured: when either replaces its buffers (`generation`), the
graphs captured over the old ones go. Graphs share one memory pool; their logits land in one buffer.

Shapes: R rows of the batch  B rows of the bucket  V vocabulary
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from server.lora.adapter_buffers import AdapterBuffers
from server.lora.layers import AdapterSlot, use_adapter_rows
from server.sampling.static_cache import StaticBatchCache

logger = logging.getLogger(__name__)

# Buckets whose graphs are kept (least recently used out first): rows are powers of two and columns
# multiples of the cache's step, so a batch of a few hundred rows and a few thousand positions uses a few dozen.
MAX_GRAPHS = 48
# Eager runs of a bucket before its capture, on a side stream (lazy initialisations, cuDNN's plans).
_WARMUP_RUNS = 2


@dataclass(frozen=True)
class DecodeSettings:
    """How the running batch decodes, for full-attention models (others grow a DynamicCache every step)."""

    mode: str = "graphs"
    """graphs (a static cache, steps replayed as CUDA graphs on a CUDA device), static (the same, eagerly) or
    dynamic (a DynamicCache that grows a position every step)."""
    rows: int = 8
    columns: int = 256
    """The static cache's first capacities (they double as needed)."""
    column_step: int | None = None
    """Columns of a decode bucket are a multiple of it; None: 256 on a CUDA device (few graphs), 32 elsewhere."""


class DecodeRunner:
    """Runs decode steps of one model copy over its static cache; counts captures and replays."""

    def __init__(self, model: torch.nn.Module, slot: AdapterSlot, cache: StaticBatchCache, graphs: bool):
        self.model, self.slot, self.cache = model, slot, cache
        self.graphs_enabled = graphs and cache.device.type == "cuda"
        self.graphs: OrderedDict[tuple, torch.cuda.CUDAGraph] = OrderedDict()
        self.captures = 0
        self.replays = 0
        self._pool = None
        self._logits_RV: torch.Tensor | None = None
        self._cache_generation: int | None = None
        self._adapters_generation: int | None = None

    def logits(self, token_R: torch.Tensor, position_R: torch.Tensor, adapter_R: torch.Tensor,
               adapters: AdapterBuffers | None) -> torch.Tensor:
        """Feed every row its token, write its keys and values at the write column, and return each row's
        next-token logits [R, V] (fp32; a view that the next step overwrites)."""
        rows, columns = self.cache.prepare_step(token_R, position_R, adapter_R)
        used = len(token_R)
        try:
            if not self.graphs_enabled:
                with torch.no_grad():
                    return self._forward(rows, columns, adapters)[:used]
            key = (rows, columns, self.cache.generation, adapters.generation if adapters is not None else None)
            graph = self.graphs.get(key)
            if graph is None:
                graph = self._capture(key, adapters)
                if graph is None:
                    with torch.no_grad():
                        return self._forward(rows, columns, adapters)[:used]
            else:
                self.graphs.move_to_end(key)
                graph.replay()
                self.replays += 1
            return self._logits_RV[:used]
        finally:
            self.cache.finish_step()

    def _forward(self, rows: int, columns: int, adapters: AdapterBuffers | None) -> torch.Tensor:
        """The language model and the last position's logits [B, V] (fp32), over a bucket."""
        with use_adapter_rows(self.slot, adapters, self.cache.adapter_R[:rows]):
            hidden_B1D = self.model.model(**self.cache.inputs(rows, columns)).last_hidden_state
            return self.model.lm_head(hidden_B1D)[:, -1].float()

    def _capture(self, key: tuple, adapters: AdapterBuffers | None) -> torch.cuda.CUDAGraph | None:
        """Capture the bucket's step (after warm-up runs, which compute this step's outputs already); None where
        the model cannot be captured (then every step runs eagerly)."""
        rows, columns, generation, adapters_generation = key
        if self._cache_generation != generation:  # the cache's buffers were replaced: every graph goes
            self.graphs.clear()
            vocabulary = self.model.lm_head.base.out_features
            self._logits_RV = torch.empty(self.cache.row_capacity, vocabulary, device=self.cache.device)
            self._cache_generation = generation
        if adapters_generation is not None and adapters_generation != self._adapters_generation:
            self.graphs = OrderedDict((k, g) for k, g in self.graphs.items() if k[3] is None)
            self._adapters_generation = adapters_generation
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        if not self.graphs:
            # A pool lives while a graph captured into it does: with none left, its handle is stale (PyTorch
            # asserts on a capture into it), so the next graph starts a pool of its own.
            self._pool = None
        try:
            with torch.no_grad():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(_WARMUP_RUNS):
                        self._logits_RV[:rows] = self._forward(rows, columns, adapters)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                # thread_local: a trainer's CUDA calls on other threads may go on during the capture
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    self._logits_RV[:rows] = self._forward(rows, columns, adapters)
        except Exception:
            logger.exception("the decode step of %d rows x %d columns could not be captured as a CUDA graph; "
                             "decode steps run eagerly from now on", rows, columns)
            self.graphs_enabled = False
            self.graphs.clear()
            return None
        self.graphs[key] = graph
        self.captures += 1
        logger.info("captured the decode step of %d rows x %d columns as a CUDA graph (%d kept, %d captured)",
                    rows, columns, len(self.graphs), self.captures)
        return graph
