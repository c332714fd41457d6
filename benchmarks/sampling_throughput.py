"""Sampling throughput on an RL-shaped load: the embedded engine against vLLM, same model, prompts and adapters.

    python -m benchmarks.sampling_throughput [--family qwen2-vl] [--runs 8] [--rounds 3] [--max-tokens 32]

Run from the repository root (so that `server` is this checkout). RL samples with many runs at
once: here `--runs` adapters with Tinker's default LoRA config (rank 32 on every attention and MLP
projection and on lm_head, random non-zero weights) each send one request per prompt every round,
4 or 8 samples each, and every request of a round is in flight together. Text and image prompts
are separate workloads. Both engines are built as the server builds them and take the server's
SamplingRequests: the embedded engine in this process, and vLLM (from .venv-vllm, with the
server's plugin, adapters loaded by path) as a child process. A third workload scores prompts
with the adapters (compute_logprobs: prompt logprobs, one new token): with LoRA, vLLM leaves that
to the embedded engine (server/sampling/vllm.py), so it is measured there against a vLLM that
serves it (a second vLLM without LoRA, base model). Completions ignore EOS: every sample has
exactly --max-tokens tokens on both engines. Prints one markdown table.
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
import torch
from PIL import Image

from benchmarks.process_memory import process_group, rss_mib
from server.config import DEFAULT_VLLM_PYTHON, ImageConfig, ModelConfig, SamplerConfig, VLLMConfig
from server.lora.checkpoint_io import save_peft_adapter
from server.lora.layers import LoraAdapter, apply_lora_wrappers
from server.models.loading import load_base_model
from server.rendering.chunks import RenderContext
from server.rendering.images import ImagePreparer
from server.rendering.sampling import VLLMRenderer
from server.sampling.embedded import EmbeddedEngine
from server.sampling.types import AdapterRef, LogprobOptions, SamplingOptions, SamplingRequest
from server.sampling.vllm import VLLMEngine
from server.sampling.vllm_process import ServedModel, VLLMProcess
from server.wire.model_input import EncodedTextChunk, ImageChunk, ModelInput

WORDS = "the red square is left of a small blue circle and the picture shows one two three big shapes".split()
RANK = 32  # Tinker's default LoraConfig: rank 32, train_attn, train_mlp and train_unembed all on
ALPHA = 32.0


@dataclass
class Result:
    engine: str
    workload: str
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


def text_prompt(tokenizer, index: int) -> ModelInput:
    words = " ".join(WORDS[(index * 7 + j * 3) % len(WORDS)] for j in range(12 + 6 * (index % 4)))
    return ModelInput(chunks=[EncodedTextChunk(tokens=tokenizer.encode(
        f"<|im_start|>user\n{words}<|im_end|>\n<|im_start|>assistant\n"))])


def image_prompt(tokenizer, num_tokens: int, index: int, size: int) -> ModelInput:
    """A user turn with one noise image (a distinct one per index) between the model's vision tokens."""
    pixels = np.random.default_rng(index).integers(0, 256, (size, size, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    return ModelInput(chunks=[
        EncodedTextChunk(tokens=tokenizer.encode("<|im_start|>user\n<|vision_start|>")),
        ImageChunk(data=png.getvalue(), format="png", expected_tokens=num_tokens),
        EncodedTextChunk(tokens=tokenizer.encode("<|vision_end|>What is in the picture?<|im_end|>\n"
                                                 "<|im_start|>assistant\n"))])


def rl_round(prompts, adapters: list[AdapterRef], max_tokens: int, round_index: int) -> list[SamplingRequest]:
    """One RL step's sampling: every run samples every prompt, 4 or 8 samples per request."""
    return [SamplingRequest(prompt=prompt, adapter=adapter, num_samples=4 if (run + index) % 2 else 8,
                            options=SamplingOptions(max_tokens=max_tokens, temperature=1.0,
                                                    seed=1000 * round_index + 10 * run + index))
            for run, adapter in enumerate(adapters) for index, prompt in enumerate(prompts)]


def run(engine_name: str, engine, workload: str, rounds: list[list[SamplingRequest]], pids) -> Result:
    """Send each round's requests all at once; rounds one after another, like RL steps."""
    num_tokens = num_requests = 0
    with PeakRss(pids) as rss:
        start = time.perf_counter()
        for requests in rounds:
            with ThreadPoolExecutor(len(requests)) as pool:
                outputs = list(pool.map(engine.sample, requests))
            num_requests += len(requests)
            num_tokens += sum(len(s.tokens) for out in outputs for s in out.sequences)
        seconds = time.perf_counter() - start
    return Result(engine_name, workload, seconds, num_requests, num_tokens, rss.peak)


def write_adapters(base, count: int, directory: Path) -> list[AdapterRef]:
    """`count` adapters of the default config with random weights, in memory and as PEFT directories."""
    targets, _ = apply_lora_wrappers(base.model, base.family)
    adapters = []
    for seed in range(count):
        adapter = LoraAdapter.initialize(targets, RANK, ALPHA, seed, "cpu").frozen_copy()
        generator = torch.Generator().manual_seed(seed)
        for name, lora_B in adapter.lora_B.items():
            adapter.lora_B[name] = torch.randn(lora_B.shape, generator=generator) * 0.01
        save_peft_adapter(directory / f"run-{seed}", adapter, base.name)
        adapters.append(AdapterRef(name=f"run-{seed}", directory=directory / f"run-{seed}", weights=adapter))
    return adapters


def start_vllm(args, base, cache: Path, max_loras: int) -> VLLMProcess:
    config = VLLMConfig(python=args.vllm_python, max_model_len=2048, max_num_seqs=256, max_loras=max_loras,
                        max_lora_rank=RANK, max_cpu_loras=max(max_loras, 1), kv_cache_space_gib=2,
                        enforce_eager=not args.no_enforce_eager, chunked_prefill=False)
    served = ServedModel(directory=base.path, name=base.name, dtype="float32",
                         refused_token_ids=base.vision.reserved_token_ids if base.vision else frozenset())
    server = VLLMProcess(config, served, log_path=cache / f"vllm-{max_loras}.log")
    server.wait_until_ready()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2-vl", help="built-in tiny VLM family")
    parser.add_argument("--runs", type=int, default=8, help="training runs (adapters) sampling at once")
    parser.add_argument("--prompts", type=int, default=2, help="prompts each run samples per round")
    parser.add_argument("--rounds", type=int, default=3, help="RL steps timed (one untimed round first)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224, help="side of the image-prompt workload's images")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--no-enforce-eager", action="store_true", help="let vLLM compile (slow start on CPU)")
    args = parser.parse_args()

    cache = Path(tempfile.mkdtemp(prefix="bench-sampling-"))
    model_config = ModelConfig(base_model=f"builtin:tiny-{args.family}", model_path=None, model_cache_dir=cache)
    base = load_base_model(model_config)
    renderer = VLLMRenderer(RenderContext.build(base, 2048, ImagePreparer(base.vision.processor, ImageConfig())))
    image_tokens = base.vision.processor.num_tokens(args.image_size, args.image_size)
    text = [renderer.render(text_prompt(base.tokenizer, i)) for i in range(args.prompts)]
    images = [renderer.render(image_prompt(base.tokenizer, image_tokens, i, args.image_size))
              for i in range(args.prompts)]
    adapters = write_adapters(base, args.runs, cache / "adapters")
    workloads = {name: [rl_round(prompts, adapters, args.max_tokens, r) for r in range(args.rounds + 1)]
                 for name, prompts in [("RL, text", text), ("RL, one image", images)]}
    # compute_logprobs of a sampled continuation, with each run's adapter.
    scored = [renderer.render(ModelInput(chunks=p.chunks + [EncodedTextChunk(tokens=list(range(100, 164)))]))
              for p in (text_prompt(base.tokenizer, i) for i in range(args.prompts))]
    scoring = [[SamplingRequest(prompt=prompt, adapter=adapter, options=SamplingOptions(max_tokens=1),
                                logprobs=LogprobOptions(prompt_logprobs=True))
                for adapter in adapters for prompt in scored] for _ in range(args.rounds + 1)]
    self_pid = [os.getpid()]
    results = []

    embedded = EmbeddedEngine.on_demand(model_config, ImageConfig().feature_cache_bytes, None, SamplerConfig())
    for name, rounds in [*workloads.items(), ("scoring (compute_logprobs)", scoring)]:
        run("embedded", embedded, name, rounds[:1], lambda: self_pid)  # warm-up (and the model's first load)
        results.append(run("embedded", embedded, name, rounds[1:], lambda: self_pid))
    embedded.close()

    started = time.perf_counter()
    server = start_vllm(args, base, cache, max_loras=args.runs)
    start_seconds = time.perf_counter() - started
    try:
        vllm = VLLMEngine([server])
        for name, rounds in workloads.items():
            run("vLLM", vllm, name, rounds[:1], lambda: process_group(server.pid))
            results.append(run("vLLM", vllm, name, rounds[1:], lambda: process_group(server.pid)))
    finally:
        server.close()
    # The scoring load on a vLLM that serves prompt logprobs: without LoRA, so the base model.
    server = start_vllm(args, base, cache, max_loras=0)
    try:
        vllm = VLLMEngine([server])
        base_scoring = [[SamplingRequest(prompt=r.prompt, options=r.options, logprobs=r.logprobs) for r in requests]
                        for requests in scoring]
        run("vLLM", vllm, "scoring", base_scoring[:1], lambda: process_group(server.pid))
        results.append(run("vLLM without LoRA (base model)", vllm, "scoring (compute_logprobs)", base_scoring[1:],
                           lambda: process_group(server.pid)))
    finally:
        server.close()

    print(f"\ntiny {args.family} (fp32); {args.runs} runs x {args.prompts} prompts per round, {args.rounds} rounds, "
          f"4 or 8 samples per request, {args.max_tokens} new tokens per sample; LoRA rank {RANK} with lm_head; "
          f"text prompts of {min(p.num_positions for p in text)}-{max(p.num_positions for p in text)} tokens, image "
          f"prompts of {images[0].num_positions} positions ({image_tokens} image tokens); scoring: "
          f"{scored[0].num_positions}-{scored[-1].num_positions} positions; vLLM started in {start_seconds:.0f} s\n")
    print("| workload | engine | requests/s | generated tokens/s | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r.workload} | {r.engine} | {r.num_requests / r.seconds:.1f} | {r.num_tokens / r.seconds:.0f} | "
              f"{r.peak_rss_mib:.0f} |")


if __name__ == "__main__":
    main()
