"""The sampler-trainer logprob gap on image-conditioned tokens against text tokens, per sampling engine.

    python -m benchmarks.logprob_gap                     (CPU: builtin:tiny-qwen2-vl, float32: gaps ~1e-7)
    python -m benchmarks.logprob_gap --sampler embedded,vllm --num-prompts 4
    python -m benchmarks.logprob_gap --device cuda --dtype bfloat16 --base-model builtin:smollm2-135m-qwen2-vl \\
        --models-dir /tmp/models --json $OUT/logprob_gap.json

RL on Tinker takes the sampler's logprobs as the behaviour policy's and the trainer's as the learner's;
what they disagree on is off-policy noise (hosted Tinker users report up to 1.9 nats on identical image
datums). For each engine (`python -m server --sampler ENGINE`, driven by the tinker SDK), --num-prompts
prompts with 1 to --max-images Pillow-drawn pictures (a shaded background, shapes, a digit) and as many
text-only prompts of about the same length (the same scenes told in words) are each sampled once
(temperature 1, --max-tokens new tokens, seed = the prompt's index) with:
- `base`: the base model's sampling client; the trainer's view is a fresh adapter (zero, so the base);
- `adapter`: a LoRA adapter after --train-steps forward_backward + optim_step on other such prompts,
  through save_weights_and_get_sampling_client.
The trainer's logprobs of prompt + completion come from `training_client.forward` (cross_entropy), and
are compared on the completion's tokens with `sample` (the sampled tokens' logprobs) and with
`compute_logprobs` (the sampler scoring the same sequence: the "identical datum" case; on
`--sampler vllm` with LoRA on, the server scores on its embedded engine, README "Sampling engines").
For the adapter, `base model` is the base model's sampling client scoring the adapter's completions:
how far training moved the model, the scale a sampler that dropped the adapter would be off by.
The table: tokens compared, mean / p99 / max |sampler - trainer| in nats and the mean of
(sampler - trainer), per (engine, weights, prompt kind, source). Peak memory is the GPU's in use (every
process, this client's CUDA context included) or, on CPU, the RSS of the server's process tree.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tinker import types

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests"))  # the test tiers' support package

from benchmarks.process_memory import PeakMemory, process_tree  # noqa: E402
from support.live_server import start_server  # noqa: E402
from support.sdk import forward_logprobs  # noqa: E402
from support.vision_sdk import ImagePrompts  # noqa: E402

COLOURS = {"red": (200, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 200), "yellow": (230, 200, 40),
           "purple": (130, 50, 160), "orange": (240, 140, 30), "black": (20, 20, 20), "white": (245, 245, 245)}
SHAPES = ("circle", "square", "triangle")
SEGMENTS = ("abcdef", "bc", "abged", "abgcd", "fgbc", "afgcd", "afgedc", "abc", "abcdefg", "abcdfg")  # seven-segment
IMAGE_QUESTION = "Describe the picture: which shapes, which colours, and which number do you see?"
TEXT_QUESTION = "Describe this picture in your own words: which shapes, which colours, and which number?"
TRAIN_SEEDS = 10_000  # the adapter trains on scenes from here on, never on the measured ones


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--base-model", default="builtin:tiny-qwen2-vl")
    parser.add_argument("--models-dir", type=Path, default=None, help="built-in models (default WORK_DIR/models)")
    parser.add_argument("--sampler", default="embedded", help="comma-separated engines, of: embedded, vllm")
    parser.add_argument("--vllm-python", type=Path, default=REPO_ROOT / ".venv-vllm" / "bin" / "python")
    parser.add_argument("--server-args", default="", help="more flags for python -m server")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts of each kind (image, text)")
    parser.add_argument("--max-images", type=int, default=2, help="image prompts hold 1 to this many pictures")
    parser.add_argument("--image-size", type=int, default=224, help="pixels a side")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--lora-targets", default="attn,mlp,unembed",
                        help="what the adapter trains, of attn, mlp (a MoE's routed experts), unembed: `mlp` "
                             "alone on a MoE checks that the sampler applies the experts' factors")
    parser.add_argument("--train-steps", type=int, default=4)
    parser.add_argument("--train-batch", type=int, default=8, help="datums a step, half of them with pictures")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/logprob-gap"))
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args()


def scene(seed: int, size: int) -> tuple[Image.Image, str]:
    """A picture (a shaded background, 2-4 outlined shapes, a digit, a little sensor noise) and its description."""
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    top, bottom = (str(name) for name in rng.choice(names, 2, replace=False))
    ramp = np.linspace(0, 1, size)[:, None, None]
    shade = np.array(COLOURS[top]) * (1 - ramp) + np.array(COLOURS[bottom]) * ramp
    pixels = np.broadcast_to(0.6 * shade + 0.4 * 255, (size, size, 3)) + rng.normal(0, 6, (size, size, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    described = []
    for _ in range(rng.integers(2, 5)):
        shape, colour = SHAPES[rng.integers(len(SHAPES))], names[rng.integers(len(names))]
        x, y = (int(v) for v in rng.integers(0, size * 2 // 3, 2))
        side = int(rng.integers(size // 6, size // 3))
        box = (x, y, x + side, y + side)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour], outline=(0, 0, 0), width=2)
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour], outline=(0, 0, 0), width=2)
        else:
            draw.polygon([(x, y + side), (x + side // 2, y), (x + side, y + side)], fill=COLOURS[colour],
                         outline=(0, 0, 0))
        described.append(f"{'an' if colour[0] in 'aeiou' else 'a'} {colour} {shape}")
    digit = int(rng.integers(10))
    left, top_edge, width = size * 0.68, size * 0.55, size * 0.18  # drawn, not typeset: the same on every Pillow
    ends = {"a": ((0, 0), (1, 0)), "b": ((1, 0), (1, 1)), "c": ((1, 1), (1, 2)), "d": ((0, 2), (1, 2)),
            "e": ((0, 1), (0, 2)), "f": ((0, 0), (0, 1)), "g": ((0, 1), (1, 1))}
    for segment in SEGMENTS[digit]:
        draw.line([(left + x * width, top_edge + y * width) for x, y in ends[segment]], fill=(0, 0, 0),
                  width=max(2, size // 40))
    return image, f"{', '.join(described)} and the number {digit}, on a pale {top} to {bottom} background"


class Cases:
    """Image prompts and text-only prompts of about the same length, chat-formatted for one model."""

    def __init__(self, prompts: ImagePrompts, args):
        self.prompts, self.args = prompts, args

    def image(self, index: int, seed: int) -> tuple[list, list[str]]:
        scenes = [scene(seed * 8 + k, self.args.image_size) for k in range(index % self.args.max_images + 1)]
        return self.prompts.user_turn([image for image, _ in scenes], IMAGE_QUESTION), [text for _, text in scenes]

    def text(self, descriptions: list[str], length: int) -> list:
        """The same scenes told in words, told again until the prompt is about `length` tokens long."""
        told = self.prompts.ids(" ".join(f"Picture {k + 1} shows {text}." for k, text in enumerate(descriptions)))
        overhead = sum(chunk.length for chunk in self.prompts.user_turn([], TEXT_QUESTION))
        words = (told * (length // len(told) + 1))[:max(length - overhead, len(told))]
        return self.prompts.user_turn([], f"{self.prompts.tokenizer.decode(words)} {TEXT_QUESTION}")

    def pair(self, index: int, seed: int) -> tuple[list, list, str]:
        """(image prompt, its text twin, the first scene's description)."""
        image_chunks, descriptions = self.image(index, seed)
        return image_chunks, self.text(descriptions, sum(chunk.length for chunk in image_chunks)), descriptions[0]


def continuation(prompt_chunks: list, tokens: list[int]):
    """The prompt plus a sampled completion, with the completion as targets (what forward scores)."""
    prompt_length = types.ModelInput(chunks=prompt_chunks).length
    model_input = types.ModelInput(chunks=prompt_chunks + [types.EncodedTextChunk(tokens=tokens[:-1])])
    targets = [0] * (prompt_length - 1) + tokens
    return types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": targets,
                                                                "weights": [0.0] * (prompt_length - 1) +
                                                                [1.0] * len(tokens)})


def gaps(sampler, training, cases: dict[str, list], args, base=None) -> dict[str, dict[str, np.ndarray]]:
    """(sampler - trainer) on every completion token, per prompt kind and per source (sample, compute_logprobs);
    with `base` (the base model's sampling client), also (base - trainer): how far training moved the model."""
    out = {}
    for kind, prompts in cases.items():
        futures = [sampler.sample(types.ModelInput(chunks=chunks), num_samples=1, sampling_params=types.SamplingParams(
            max_tokens=args.max_tokens, temperature=1.0, seed=index, stop=[])) for index, chunks in enumerate(prompts)]
        sequences = [future.result().sequences[0] for future in futures]
        data = [continuation(chunks, sequence.tokens) for chunks, sequence in zip(prompts, sequences)]
        scorers = {"compute_logprobs": sampler, **({"base model": base} if base is not None else {})}
        scored = {source: [scorer.compute_logprobs(datum.model_input.append_int(sequence.tokens[-1]))
                           for datum, sequence in zip(data, sequences)] for source, scorer in scorers.items()}
        trainer = np.concatenate([logprobs[-len(sequence.tokens):] for logprobs, sequence in
                                  zip(forward_logprobs(training, data), sequences)])
        out[kind] = {"sample": np.concatenate([sequence.logprobs for sequence in sequences]) - trainer}
        for source, futures in scored.items():
            out[kind][source] = np.concatenate([future.result()[-len(sequence.tokens):]
                                                for future, sequence in zip(futures, sequences)]) - trainer
    return out


def summary(difference: np.ndarray) -> dict:
    magnitude = np.abs(difference)
    return {"tokens": int(difference.size), "mean_abs": float(magnitude.mean()),
            "p99_abs": float(np.percentile(magnitude, 99)), "max_abs": float(magnitude.max()),
            "bias": float(difference.mean())}


def run_engine(args, engine: str) -> dict:
    """One server on `engine`: the gaps of the base model, then of an adapter after a few steps."""
    flags = ["--device", args.device, "--dtype", args.dtype, "--sampler", engine, *args.server_args.split()]
    if engine == "vllm":
        flags += ["--vllm-python", str(args.vllm_python)]
    server = start_server(args.work_dir / engine, None, args.models_dir, *flags, base_model=args.base_model,
                          startup_seconds=1800)
    try:
        with PeakMemory(args.device, lambda: process_tree(server.process.pid)) as memory:
            service = server.service_client()
            targets = set(args.lora_targets.split(","))
            training = service.create_lora_training_client(
                base_model=args.base_model, rank=args.lora_rank, seed=0, train_attn="attn" in targets,
                train_mlp="mlp" in targets, train_unembed="unembed" in targets).result()
            prompts = ImagePrompts(training)
            build = Cases(prompts, args)
            pairs = [build.pair(index, index) for index in range(args.num_prompts)]
            cases = {"image": [image for image, _, _ in pairs], "text": [text for _, text, _ in pairs]}
            lengths = {kind: float(np.mean([types.ModelInput(chunks=c).length for c in chunks]))
                       for kind, chunks in cases.items()}
            base = service.create_sampling_client(base_model=args.base_model).result()
            rows, losses = {"base": gaps(base, training, cases, args)}, []
            for step in range(args.train_steps):
                batch = [build.pair(index, TRAIN_SEEDS + step * args.train_batch + index)
                         for index in range(args.train_batch // 2)]
                data = [prompts.datum(chunks, f"I see {description}.") for image, text, description in batch
                        for chunks in (image, text)]
                loss = training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
                losses.append(loss / sum(sum(datum.loss_fn_inputs["weights"].tolist()) for datum in data))
                training.optim_step(types.AdamParams(learning_rate=args.learning_rate)).result()
            adapter = training.save_weights_and_get_sampling_client().result()
            rows["adapter"] = gaps(adapter, training, cases, args, base)
            service.close("success").result()
        return {"prompt_lengths": lengths, "train_nll": losses, "peak_memory_gib": memory.peak,
                "rows": [{"engine": engine, "weights": weights, "prompts": kind, "source": source,
                          **summary(difference)}
                         for weights, by_kind in rows.items() for kind, by_source in by_kind.items()
                         for source, difference in by_source.items()]}
    finally:
        server.stop(timeout=120)


def print_table(results: dict) -> None:
    columns = ("engine", "weights", "prompts", "source", "tokens", "mean |d|", "p99 |d|", "max |d|", "bias",
               "peak memory GiB")
    print("\n| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for result in results.values():
        for row in result["rows"]:
            numbers = [f"{row[key]:.2e}" for key in ("mean_abs", "p99_abs", "max_abs")]
            print("| " + " | ".join([*(row[key] for key in columns[:4]), str(row["tokens"]), *numbers,
                                     f"{row['bias']:+.2e}", f"{result['peak_memory_gib']:.2f}"]) + " |")


def main() -> None:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.models_dir = (args.models_dir or args.work_dir / "models").resolve()
    args.models_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for engine in args.sampler.split(","):
        results[engine] = run_engine(args, engine)
        print(f"{engine}: mean prompt lengths {results[engine]['prompt_lengths']}, the adapter's training NLL per "
              f"token by step {[round(loss, 3) for loss in results[engine]['train_nll']]}", flush=True)
    print(f"\n{args.base_model} on {args.device} ({args.dtype}); {args.num_prompts} prompts of each kind, "
          f"{args.max_tokens} new tokens each; d = sampler - trainer, in nats; bias = mean d")
    print_table(results)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()
