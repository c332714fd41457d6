"""Sampling throughput: vLLM (VLLMSampler) against the embedded engine, same model, same prompts, one run.

    python -m benchmarks.sampling_throughput [--family qwen2-vl] [--requests 64] [--concurrency 32] [--max-tokens 64]

Run from the repository root (so that `server` is this checkout). Builds the built-in tiny model,
starts vLLM from .venv-vllm (scripts/install_vllm.sh), and prints a markdown table: requests/s,
generated tokens/s and peak RSS per engine and workload. Text prompts only for now: image prompts
need the renderer that produces both engines' inputs. Completions ignore EOS, so every request
generates exactly --max-tokens tokens per sample and the token counts of both engines are equal.
"""

import argparse
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from server.config import ModelConfig
from server.models.loading import load_base_model
from server.rendering.chunks import RenderedInput
from server.sampling.embedded import EmbeddedSampler
from server.sampling.types import SamplingOptions
from server.sampling.vllm import VLLMSampler
from server.sampling.vllm_process import VLLMConfig, VLLMProcess

WORDS = "the red square is left of a small blue circle and the picture shows one two three big shapes".split()


@dataclass
class Workload:
    name: str
    num_requests: int
    num_samples: int


@dataclass
class Result:
    engine: str
    workload: str
    concurrency: int
    seconds: float
    num_requests: int
    num_tokens: int
    peak_rss_mib: float


def _rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            pass
    return total / 1024


def _process_group(pgid: int) -> list[int]:
    """Every process of a process group (vLLM's API server, engine core and workers)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    # Field 5 is the process group; the command name (field 2) may hold spaces.
                    if int(stat.read().rsplit(")", 1)[1].split()[2]) == pgid:
                        members.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return members


class PeakRss:
    """Samples the RSS of some processes every 50 ms and keeps the maximum."""

    def __init__(self, pids):
        self.pids = pids
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _rss_mib(self.pids()))

    def __enter__(self):
        self.peak = _rss_mib(self.pids())
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run(engine: str, sample, prompts: list[list[int]], workload: Workload, concurrency: int, pids) -> Result:
    """Send the workload's requests, `concurrency` at a time, and time them."""
    requests = [prompts[i % len(prompts)] for i in range(workload.num_requests)]
    with PeakRss(pids) as rss:
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outputs = list(pool.map(lambda prompt: sample(prompt, workload.num_samples), requests))
        seconds = time.perf_counter() - start
    num_tokens = sum(len(s.tokens) for out in outputs for s in out.sequences)
    return Result(engine, workload.name, concurrency, seconds, len(requests), num_tokens, rss.peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2-vl", help="built-in tiny model family")
    parser.add_argument("--requests", type=int, default=64, help="requests of the one-sample workload")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight for the concurrent runs")
    parser.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"))
    parser.add_argument("--no-enforce-eager", action="store_true", help="let vLLM compile (slow start on CPU)")
    args = parser.parse_args()

    cache = Path(tempfile.mkdtemp(prefix="bench-models-"))
    base = load_base_model(ModelConfig(base_model=f"builtin:tiny-{args.family}", model_path=None,
                                       model_cache_dir=cache))
    prompts = []
    for i in range(16):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(8 + 4 * i)]
        prompts.append(base.tokenizer(f"<|im_start|>user\n{' '.join(words)}<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    options = SamplingOptions(max_tokens=args.max_tokens, temperature=1.0, seed=0)  # no stop: exact lengths
    workloads = [Workload(f"{args.requests} x 1 sample", args.requests, 1),
                 Workload(f"{args.requests // 4} x 8 samples", args.requests // 4, 8)]

    embedded = EmbeddedSampler(base.model, base.tokenizer)
    self_pid = [os.getpid()]
    results = []
    embedded.sample(RenderedInput(prompts[0], [], None), options)  # warm-up
    for workload in workloads:
        # The server runs embedded sampling on one thread, one request at a time.
        results.append(run("embedded (HF)", lambda p, n: embedded.sample(RenderedInput(p, [], None), options, num_samples=n),
                           prompts, workload, 1, lambda: self_pid))

    config = VLLMConfig(python=args.vllm_python, max_model_len=2048, max_num_seqs=64, max_loras=2, max_lora_rank=8,
                        max_cpu_loras=2, kv_cache_space_gib=2, enforce_eager=not args.no_enforce_eager,
                        chunked_prefill=False)
    started = time.perf_counter()
    server = VLLMProcess(config, model_dir=base.path, dtype="float32", served_model_name=base.name,
                         log_path=cache / "vllm.log")
    try:
        server.wait_until_ready()
        start_seconds = time.perf_counter() - started
        sampler = VLLMSampler(server)
        sampler.sample(prompts[0], options)  # warm-up
        def group() -> list[int]:
            return _process_group(server.pid)

        for workload in workloads:
            for concurrency in (1, args.concurrency):
                results.append(run("vLLM", lambda p, n: sampler.sample(p, options, num_samples=n), prompts,
                                   workload, concurrency, group))
        sampler.close()
    finally:
        server.close()

    print(f"\ntiny {args.family} (fp32), {args.max_tokens} new tokens per sample, prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens; vLLM started in {start_seconds:.0f} s\n")
    print("| workload | engine | requests in flight | requests/s | generated tokens/s | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|")
    order = [w.name for w in workloads]
    for r in sorted(results, key=lambda r: (order.index(r.workload), r.engine == "vLLM", r.concurrency)):
        print(f"| {r.workload} | {r.engine} | {r.concurrency} | {r.num_requests / r.seconds:.1f} | "
              f"{r.num_tokens / r.seconds:.0f} | {r.peak_rss_mib:.0f} |")


if __name__ == "__main__":
    main()
