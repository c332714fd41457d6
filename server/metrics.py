"""Prometheus metrics of one server: HTTP requests, per-run queue depth, request latency, tokens, GPU memory.

`ServerMetrics` owns its own registry (so several apps in one process never collide) and is written
to by the middleware in app.py, the scheduler and the routes; `GET /metrics` renders it. It knows
nothing about what the requests do.
"""

import threading
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.http_requests = Counter("tinker_http_requests", "HTTP requests by route template, method and status",
                                     ["route", "method", "status"], registry=self.registry)
        self.request_seconds = Histogram(
            "tinker_request_seconds", "Time a request's work ran on its worker thread (forward_backward, "
            "optim_step, checkpoints, sampling), by request type and outcome", ["request_type", "outcome"],
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_depth = Gauge("tinker_run_queue_depth", "Requests of a training run queued or running",
                                 ["model_id"], registry=self.registry)
        self.tokens = Counter("tinker_tokens", "Tokens processed: trained (forward/backward input positions), "
                              "sampled (generated), and sampling prompts' positions taken from the prefix cache "
                              "(prompt_cached) or run (prompt_computed); rate() gives tokens/s", ["kind"],
                              registry=self.registry)
        self.pass_runs = Histogram("tinker_training_pass_runs", "Training runs whose forward_backward datums "
                                   "shared one pass", buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.unjournaled = Gauge("tinker_unjournaled_outcomes", "Finished requests whose outcome the journal "
                                 "could not take yet (disk full); answered from memory meanwhile",
                                 registry=self.registry)
        self.registry.register(_GpuMemory())
        self._queue_depths: dict[str, int] = {}
        self._sampling: dict[str, SamplingTally] = {}
        """Per tenant (one entry per tenant that sampled: bounded by the keys issued)."""
        self._sampling_lock = threading.Lock()  # responses are also made on worker threads
        self._children: dict[tuple, Counter | Histogram] = {}
        """Each labelled series used, by (metric, labels): `labels()` takes a lock and checks its values, a few
        times per sample request."""

    def _series(self, metric: Counter | Histogram, *labels: str) -> Counter | Histogram:
        key = (metric, *labels)
        series = self._children.get(key)
        if series is None:
            series = self._children[key] = metric.labels(*labels)
        return series

    def count_http(self, route: str, method: str, status: int) -> None:
        self._series(self.http_requests, route, method, str(status)).inc()

    def observe_request(self, request_type: str, outcome: str, seconds: float) -> None:
        self._series(self.request_seconds, request_type, outcome).observe(seconds)

    def set_queue_depth(self, model_id: str, depth: int) -> None:
        self.queue_depth.labels(model_id).set(depth)
        self._queue_depths[model_id] = depth

    def queue_depth_of(self, model_id: str) -> int:
        """Requests of the run queued or running now (the dashboard reads it per tenant)."""
        return self._queue_depths.get(model_id, 0)

    def forget_run(self, model_id: str) -> None:
        self._queue_depths.pop(model_id, None)
        try:
            self.queue_depth.remove(model_id)
        except KeyError:
            pass

    def observe_pass(self, num_runs: int, num_tokens: int) -> None:
        self.pass_runs.observe(num_runs)
        self.count_tokens("trained", num_tokens)

    def count_tokens(self, kind: str, count: int) -> None:
        self._series(self.tokens, kind).inc(count)

    def count_sample(self, owner: str, sampled: int, prompt_cached: int, prompt_computed: int) -> None:
        """One sampling request answered: the server's token counters, and the tenant's tally."""
        self.count_tokens("sampled", sampled)
        self.count_tokens("prompt_cached", prompt_cached)
        self.count_tokens("prompt_computed", prompt_computed)
        with self._sampling_lock:
            tally = self._sampling.setdefault(owner, SamplingTally())
            tally.requests += 1
            tally.sampled_tokens += sampled
            tally.prompt_cached_tokens += prompt_cached
            tally.prompt_computed_tokens += prompt_computed

    def sampling_of(self, owner: str) -> "SamplingTally":
        """The tenant's sampling since the server started (the dashboard shows it to that tenant)."""
        return self._sampling.get(owner, SamplingTally())

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class SamplingTally:
    requests: int = 0
    sampled_tokens: int = 0
    prompt_cached_tokens: int = 0
    prompt_computed_tokens: int = 0


def gpu_memory() -> list[tuple[int, int, int, int]]:
    """(device, allocated, reserved, total) bytes of each GPU this process sees; none without CUDA."""
    if not torch.cuda.is_available():
        return []
    return [(index, torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index),
             torch.cuda.get_device_properties(index).total_memory) for index in range(torch.cuda.device_count())]


class _GpuMemory:
    """GPU memory of this process, read at scrape time."""

    def collect(self):
        allocated = GaugeMetricFamily("tinker_gpu_memory_allocated_bytes", "Memory held by tensors, per GPU",
                                      labels=["device"])
        reserved = GaugeMetricFamily("tinker_gpu_memory_reserved_bytes", "Memory reserved by the caching "
                                     "allocator, per GPU", labels=["device"])
        for index, in_tensors, in_allocator, _ in gpu_memory():
            allocated.add_metric([str(index)], in_tensors)
            reserved.add_metric([str(index)], in_allocator)
        yield allocated
        yield reserved
