"""How long another tenant's short request waits behind a long one that fills the embedded sampler's batch.

    python benchmarks/sampler_fairness.py                       (CPU: builtin:tiny-qwen2-vl, float32)
    python benchmarks/sampler_fairness.py --device cuda --dtype bfloat16 --long-tokens 2048

The embedded engine in this process, its batch budget (`--sampler-max-batch-tokens`) sized to hold exactly
the long request's rows: `--long-samples` samples of a `--prompt-tokens` prompt, `--long-tokens` new tokens
each (EOS ignored). Once the long request has decoded `--head-start` steps, a one-sample request of 4 new
tokens arrives. Printed: that short request's latency alone (idle engine) and behind the long request, and the
long request's own time. To compare with another commit, copy this file into that tree's benchmarks/ and run
it from there.
"""

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from server.config import ModelConfig  # noqa: E402
from server.rendering.chunks import RenderedInput  # noqa: E402
from server.sampling.embedded import EmbeddedEngine, load_engine_model  # noqa: E402
from server.sampling.types import SamplingOptions, SamplingRequest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", default="builtin:tiny-qwen2-vl")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--long-samples", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=512)
    parser.add_argument("--head-start", type=int, default=8, help="decode steps of the long request first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "sampler-fairness-models")
    args = parser.parse_args()

    steps = []
    forward_started = threading.Condition()

    def load():
        engine_model = load_engine_model(ModelConfig(base_model=args.base_model, model_path=None,
                                                     model_cache_dir=args.models_dir, device=args.device,
                                                     dtype=args.dtype), 1 << 26)
        inner = engine_model.model.model
        forward = inner.forward

        def counted(*positional, **call):
            with forward_started:
                steps.append(call["input_ids"].shape[0])
                forward_started.notify_all()
            return forward(*positional, **call)

        inner.forward = counted
        return engine_model

    budget = args.long_samples * (args.prompt_tokens + args.long_tokens)
    engine = EmbeddedEngine(load, max_batch_tokens=budget)
    prompt = RenderedInput(token_ids=list(range(100, 100 + args.prompt_tokens)), images=[], image_token_id=None)
    long = SamplingRequest(prompt=prompt, num_samples=args.long_samples,
                           options=SamplingOptions(max_tokens=args.long_tokens, seed=1, stop_token_ids=()))
    short = SamplingRequest(prompt=RenderedInput(token_ids=list(range(200, 200 + args.prompt_tokens)), images=[],
                                                 image_token_id=None),
                            options=SamplingOptions(max_tokens=4, seed=2, stop_token_ids=()))
    try:
        engine.sample(short)  # untimed: loads the model
        idle = []
        for _ in range(5):
            start = time.perf_counter()
            engine.sample(short)
            idle.append(time.perf_counter() - start)
        behind, long_seconds = [], []
        for _ in range(args.rounds):
            first = len(steps)
            start = time.perf_counter()
            long_future = engine.submit(long)
            with forward_started:
                forward_started.wait_for(lambda: len(steps) >= first + 1 + args.head_start)
            short_start = time.perf_counter()
            engine.sample(short)
            behind.append(time.perf_counter() - short_start)
            long_future.result()
            long_seconds.append(time.perf_counter() - start)
    finally:
        engine.close()
    print(f"{args.base_model} on {args.device} ({args.dtype}); long: {args.long_samples} x ({args.prompt_tokens} + "
          f"{args.long_tokens}) tokens, batch budget {budget} positions; short: 4 tokens, sent after "
          f"{args.head_start} decode steps of the long one; median of {args.rounds} rounds\n")
    print("| short request alone s | short request behind the long one s | long request s |")
    print("|---|---|---|")
    print(f"| {statistics.median(idle):.3f} | {statistics.median(behind):.3f} | {statistics.median(long_seconds):.2f} |")


if __name__ == "__main__":
    main()
