"""The embedded engine's own speed on short requests, by decode mode, in this process (no server, no SDK).

    python -m benchmarks.decode_steps                                         (CPU: dynamic, static)
    python -m benchmarks.decode_steps --device cuda --dtype bfloat16 --modes dynamic,static,graphs

Each mode is an engine over its own copy of `--base-model` (`dynamic`: a DynamicCache that grows a position per
step; `static`: the preallocated batch cache in buckets, eagerly; `graphs`: the same replayed as CUDA graphs). Every
round runs, mode after mode: `--idle` requests one at a time (the latency of a request on an idle engine), a
burst of `--requests` one-sample requests submitted at once (each its own text prompt, every other one with a
rank-32 LoRA adapter on every projection and lm_head), and one request of `--requests` samples. The first round warms up (graph captures,
cuDNN's plans) and is not counted; the table gives medians over the other rounds, modes alternating so that a
loaded machine slows them alike. Record results in RESULTS.md with the machine and date.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.config import ModelConfig  # noqa: E402
from server.lora.layers import LoraAdapter, apply_lora_wrappers, select_targets  # noqa: E402
from server.models.loading import load_base_model  # noqa: E402
from server.rendering.chunks import RenderContext, render_model_input  # noqa: E402
from server.sampling.decode_graphs import DecodeSettings  # noqa: E402
from server.sampling.embedded import EmbeddedEngine, load_engine_model  # noqa: E402
from server.sampling.types import AdapterRef, SamplingOptions, SamplingRequest  # noqa: E402
from server.wire.model_input import EncodedTextChunk, ModelInput  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--base-model", default="builtin:tiny-qwen2-vl")
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/decode-steps-models"))
    parser.add_argument("--modes", default="dynamic,static")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--idle", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds, after one that warms up")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    config = ModelConfig(base_model=args.base_model, model_path=None, model_cache_dir=args.models_dir,
                         device=args.device, dtype=args.dtype)
    base = load_base_model(config)
    targets, _ = apply_lora_wrappers(base.model, base.family)
    lora = LoraAdapter.initialize(select_targets(targets, train_attn=True, train_mlp=True, train_unembed=True),
                                  rank=32, alpha=32.0, seed=1, device=args.device).frozen_copy()
    adapter = AdapterRef(name="rl", directory=None, weights=lora)
    context = RenderContext.build(base, max_length=4096, images=None)  # text prompts

    def request(index: int, num_samples: int = 1) -> SamplingRequest:
        tokens = base.tokenizer.encode(f"Episode {index}: the red square is left of the blue circle. Move?")
        return SamplingRequest(prompt=render_model_input(ModelInput(chunks=[EncodedTextChunk(tokens=tokens)]),
                                                         context, "prompt"),
                               options=SamplingOptions(max_tokens=args.max_tokens, seed=index),
                               num_samples=num_samples, adapter=adapter if index % 2 else None)

    engines = {mode: EmbeddedEngine(lambda: load_engine_model(config, 1 << 26), decode=DecodeSettings(mode))
               for mode in args.modes.split(",")}
    times: dict[str, dict[str, list[float]]] = {mode: {"idle": [], "burst": [], "one": []} for mode in engines}
    try:
        for round_index in range(args.rounds + 1):
            for mode, engine in engines.items():
                idle = []
                for index in range(args.idle):
                    start = time.perf_counter()
                    engine.sample(request(index))
                    idle.append(time.perf_counter() - start)
                burst = [request(round_index * args.requests + index) for index in range(args.requests)]
                start = time.perf_counter()
                for future in [engine.submit(one) for one in burst]:
                    future.result()
                burst_seconds = time.perf_counter() - start
                start = time.perf_counter()
                engine.sample(request(1, args.requests))
                one_seconds = time.perf_counter() - start
                if round_index:
                    times[mode]["idle"].append(statistics.median(idle))
                    times[mode]["burst"].append(burst_seconds)
                    times[mode]["one"].append(one_seconds)
        print(f"\n{args.base_model} on {args.device} ({args.dtype}), {args.requests} requests of {args.max_tokens} "
              f"tokens, medians of {args.rounds} rounds")
        print("| mode | idle p50 ms | burst s | requests/s | one request of N samples s | burst / one | graphs "
              "captured | replays |")
        print("|---|---|---|---|---|---|---|---|")
        for mode, engine in engines.items():
            idle, burst, one = (statistics.median(times[mode][kind]) for kind in ("idle", "burst", "one"))
            decoder = engine.batch.decoder
            print(f"| {mode} | {idle * 1000:.1f} | {burst:.3f} | {args.requests / burst:.0f} | {one:.3f} | "
                  f"{burst / one:.1f} | {getattr(decoder, 'captures', 0)} | {getattr(decoder, 'replays', 0)} |")
        if args.device.startswith("cuda"):
            print(f"peak GPU memory {torch.cuda.max_memory_allocated() / (1 << 30):.2f} GiB")
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
