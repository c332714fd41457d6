"""Sampling throughput: vLLM (VLLMSampler) against the embedded engine, same model, same prompts, one run.

    python -m benchmarks.sampling_throughput [--family qwen2-vl] [--requests 64] [--concurrency 32] [--max-tokens 64]

Run from the repository root (so that `server` is this checkout). Builds the built-in tiny model,
starts vLLM from .venv-vllm (scripts/install_vllm.sh), and prints a markdown table: requests/s,
generated tokens/s and peak RSS per engine and workload. Prompts go through the server's own path:
tinker ModelInputs (text, or one image between the vision tokens) rendered by the VLLMRenderer,
then the server's EmbeddedEngine or VLLMEngine. Completions ignore EOS, so every request generates
exactly --max-tokens tokens per sample and the token counts of both engines are equal.
"""

import argparse
import io
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.process_memory import process_group, rss_mib
from server.config import ImageConfig, ModelConfig, SamplerConfig
from server.models.loading import load_base_model
from server.rendering.chunks import RenderContext, RenderedInput
from server.rendering.images import ImagePreparer
from server.rendering.sampling import VLLMRenderer
from server.sampling.adapters import SamplerAdapters
from server.sampling.embedded import OnDemandSampler
from server.sampling.engine import EmbeddedEngine, VLLMEngine
from server.sampling.types import SamplingOptions
from server.sampling.vllm import VLLMSampler
from server.sampling.vllm_process import VLLMConfig, VLLMProcess
from server.wire.types import EncodedTextChunk, ImageChunk, ModelInput

WORDS = "the red square is left of a small blue circle and the picture shows one two three big shapes".split()


@dataclass
class Workload:
    name: str
    prompts: list[RenderedInput]
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


class PeakRss:
    """Samples the RSS of some processes every 50 ms and keeps the maximum."""

    def __init__(self, pids):
        self.pids = pids
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mib(self.pids()))

    def __enter__(self):
        self.peak = rss_mib(self.pids())
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run(engine: str, sample, workload: Workload, concurrency: int, pids) -> Result:
    """Send the workload's requests, `concurrency` at a time, and time them."""
    requests = [workload.prompts[i % len(workload.prompts)] for i in range(workload.num_requests)]
    with PeakRss(pids) as rss:
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outputs = list(pool.map(lambda prompt: sample(prompt, workload.num_samples), requests))
        seconds = time.perf_counter() - start
    num_tokens = sum(len(s.tokens) for out in outputs for s in out.sequences)
    return Result(engine, workload.name, concurrency, seconds, len(requests), num_tokens, rss.peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2-vl", help="built-in tiny VLM family")
    parser.add_argument("--requests", type=int, default=64, help="requests of the one-sample workload")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight for the concurrent runs")
    parser.add_argument("--image-size", type=int, default=224, help="side of the image-prompt workload's images")
    parser.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"))
    parser.add_argument("--no-enforce-eager", action="store_true", help="let vLLM compile (slow start on CPU)")
    args = parser.parse_args()

    cache = Path(tempfile.mkdtemp(prefix="bench-models-"))
    model_config = ModelConfig(base_model=f"builtin:tiny-{args.family}", model_path=None, model_cache_dir=cache)
    base = load_base_model(model_config)
    renderer = VLLMRenderer(RenderContext.build(base, 2048, ImagePreparer(base.vision.processor, ImageConfig())))
    text_prompts, image_prompts = [], []
    for i in range(16):
        words = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(8 + 4 * i))
        text_prompts.append(renderer.render(ModelInput(chunks=[EncodedTextChunk(tokens=base.tokenizer.encode(
            f"<|im_start|>user\n{words}<|im_end|>\n<|im_start|>assistant\n"))])))
        image_prompts.append(renderer.render(image_prompt(base, i, args.image_size)))
    options = SamplingOptions(max_tokens=args.max_tokens, temperature=1.0, seed=0)  # no stop: exact lengths
    workloads = [Workload(f"{args.requests} x 1 sample", text_prompts, args.requests, 1),
                 Workload(f"{args.requests // 4} x 8 samples", text_prompts, args.requests // 4, 8),
                 Workload(f"{args.requests} x 1 sample, one {args.image_size}x{args.image_size} image",
                          image_prompts, args.requests, 1)]

    def sampling(engine):
        return lambda prompt, num_samples: engine.sample(prompt, options, adapter=None, num_samples=num_samples,
                                                         include_prompt_logprobs=False, topk_prompt_logprobs=0)

    embedded = EmbeddedEngine(OnDemandSampler(model_config, ImageConfig().feature_cache_bytes),
                              SamplerAdapters(SamplerConfig(), "cpu"))
    self_pid = [os.getpid()]
    results = []
    for workload in workloads:
        sampling(embedded)(workload.prompts[0], 1)  # warm-up (and the model's first load)
        # The server runs embedded sampling on one thread, one request at a time.
        results.append(run("embedded (HF)", sampling(embedded), workload, 1, lambda: self_pid))

    config = VLLMConfig(python=args.vllm_python, max_model_len=2048, max_num_seqs=64, max_loras=2, max_lora_rank=8,
                        max_cpu_loras=2, kv_cache_space_gib=2, enforce_eager=not args.no_enforce_eager,
                        chunked_prefill=False)
    started = time.perf_counter()
    server = VLLMProcess(config, model_dir=base.path, dtype="float32", served_model_name=base.name,
                         log_path=cache / "vllm.log")
    try:
        server.wait_until_ready()
        start_seconds = time.perf_counter() - started
        vllm = VLLMSampler(server)
        engine = VLLMEngine(vllm, embedded)

        def group() -> list[int]:
            return process_group(server.pid)

        for workload in workloads:
            sampling(engine)(workload.prompts[0], 1)  # warm-up
            for concurrency in (1, args.concurrency):
                results.append(run("vLLM", sampling(engine), workload, concurrency, group))
        vllm.close()
    finally:
        server.close()

    lengths = [prompt.num_positions for prompt in text_prompts]
    print(f"\ntiny {args.family} (fp32), {args.max_tokens} new tokens per sample, text prompts of "
          f"{min(lengths)}-{max(lengths)} tokens, image prompts of {image_prompts[0].num_positions} positions "
          f"({image_prompts[0].images[0].num_tokens} image tokens); vLLM started in {start_seconds:.0f} s\n")
    print("| workload | engine | requests in flight | requests/s | generated tokens/s | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|")
    order = [w.name for w in workloads]
    for r in sorted(results, key=lambda r: (order.index(r.workload), r.engine == "vLLM", r.concurrency)):
        print(f"| {r.workload} | {r.engine} | {r.concurrency} | {r.num_requests / r.seconds:.1f} | "
              f"{r.num_tokens / r.seconds:.0f} | {r.peak_rss_mib:.0f} |")


def image_prompt(base, seed: int, size: int) -> ModelInput:
    """A user turn with one noise image (a distinct one per seed) between the model's vision tokens."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    num_tokens = base.vision.processor.num_tokens(size, size)
    return ModelInput(chunks=[
        EncodedTextChunk(tokens=base.tokenizer.encode("<|im_start|>user\n<|vision_start|>")),
        ImageChunk(data=png.getvalue(), format="png", expected_tokens=num_tokens),
        EncodedTextChunk(tokens=base.tokenizer.encode("<|vision_end|>What is in the picture?<|im_end|>\n"
                                                      "<|im_start|>assistant\n"))])


if __name__ == "__main__":
    main()
