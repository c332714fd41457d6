"""A vision-language classifier trained through the Tinker SDK, written like the cookbook's vlm_classifier.

LoRA-only supervised fine-tuning of a served VLM on scikit-learn's bundled digits (1,797 real 8x8
scans, upscaled): the prompt is an image and "What digit is this?", the weighted completion is the
digit. Accuracy is measured as the recipe measures it: greedy sampling from a
save_weights_and_get_sampling_client() snapshot, exact match of the parsed answer on a held-out
split never trained on. Writes metrics.jsonl (train NLL, held-out NLL via compute_logprobs,
accuracy and the share of answers that are one digit per eval) and a PNG plot to --log-dir.

    python tests/e2e/digits_classifier.py --base-url http://127.0.0.1:8000 --log-dir /tmp/digits
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import tinker
from PIL import Image
from sklearn.datasets import load_digits
from tinker import types

from client_compat.images import ImageChunker

QUESTION = "What digit is this?"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--base-model", default="builtin:tiny-qwen2-vl")
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--image-size", type=int, default=56, help="digits are upscaled to this many pixels a side")
    parser.add_argument("--held-out-fraction", type=float, default=0.2)
    parser.add_argument("--num-nll-eval", type=int, default=100, help="held-out examples scored by compute_logprobs")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def digit_png(pixels_8x8: np.ndarray, size: int) -> Image.Image:
    """A digit scan (values 0-16, white ink) as a black-on-white greyscale image, upscaled smoothly."""
    grey = (255 - pixels_8x8 * (255 / 16)).astype(np.uint8)
    return Image.fromarray(grey, mode="L").resize((size, size), Image.BICUBIC)


class Renderer:
    """Qwen-style chat turns as chunk lists, with image chunks as the cookbook's renderers build them."""

    def __init__(self, tokenizer, chunker: ImageChunker):
        self.tokenizer = tokenizer
        self.image_chunk = chunker.chunk

    def prompt(self, image: Image.Image) -> list:
        encode = self.tokenizer.encode
        return [types.EncodedTextChunk(tokens=encode("<|im_start|>user\n<|vision_start|>")), self.image_chunk(image),
                types.EncodedTextChunk(tokens=encode(f"<|vision_end|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"))]

    def datum(self, image: Image.Image, label: int) -> types.Datum:
        """Weight 1 on the answer and its end-of-turn token; image positions get target 0, weight 0."""
        prompt = self.prompt(image)
        answer = self.tokenizer.encode(f"{label}<|im_end|>")
        tokens = []
        for chunk in prompt:
            tokens += chunk.tokens if isinstance(chunk, types.EncodedTextChunk) else [0] * chunk.expected_tokens
        tokens += answer
        weights = [0.0] * (len(tokens) - len(answer)) + [1.0] * len(answer)
        model_input = types.ModelInput(chunks=prompt + [types.EncodedTextChunk(tokens=answer[:-1])])
        return types.Datum(model_input=model_input,
                           loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]})

    def parse(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()


def mean_nll(logprobs_list, data) -> float:
    weights = [np.asarray(d.loss_fn_inputs["weights"].tolist()) for d in data]
    total = sum(-(np.asarray(lp) * w).sum() for lp, w in zip(logprobs_list, weights))
    return float(total / sum(w.sum() for w in weights))


def evaluate(sampler, renderer, test_images, test_labels, nll_data) -> dict:
    """Greedy accuracy on the whole held-out split, the share of answers that are one digit, and held-out NLL via
    compute_logprobs."""
    futures = [sampler.sample(types.ModelInput(chunks=renderer.prompt(image)), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0,
                                                                   stop=renderer.tokenizer.encode("<|im_end|>")))
               for image in test_images]
    answers = [renderer.parse(f.result().sequences[0].tokens) for f in futures]
    accuracy = float(np.mean([answer == str(label) for answer, label in zip(answers, test_labels)]))
    answered = float(np.mean([len(answer) == 1 and answer.isdigit() for answer in answers]))
    scored = [sampler.compute_logprobs(d.model_input.append_int(int(d.loss_fn_inputs["target_tokens"].tolist()[-1])))
              for d in nll_data]
    held_out_nll = mean_nll([f.result()[1:] for f in scored], nll_data)
    return {"accuracy": accuracy, "answered": answered, "held_out_nll": held_out_nll}


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (nll_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(10, 4))
    train = [r for r in records if "train_nll" in r]
    evals = [r for r in records if "accuracy" in r]
    nll_axis.plot([r["step"] for r in train], [r["train_nll"] for r in train], label="train NLL")
    nll_axis.plot([r["step"] for r in evals], [r["held_out_nll"] for r in evals], "o-", label="held-out NLL")
    nll_axis.set_xlabel("step")
    nll_axis.set_ylabel("mean NLL per answer token")
    nll_axis.legend()
    accuracy_axis.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-")
    accuracy_axis.set_xlabel("step")
    accuracy_axis.set_ylabel("held-out greedy accuracy")
    accuracy_axis.set_ylim(0, 1)
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    args = parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    digits = load_digits()
    order = np.random.default_rng(args.seed).permutation(len(digits.target))
    num_test = int(len(order) * args.held_out_fraction)
    test_index, train_index = order[:num_test], order[num_test:]
    images = [digit_png(pixels, args.image_size) for pixels in digits.images]

    service = tinker.ServiceClient(base_url=args.base_url)
    training = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=args.seed).result()
    renderer = Renderer(training.get_tokenizer(), ImageChunker(training.get_info().model_data.tokenizer_id))
    train_data = [renderer.datum(images[i], int(digits.target[i])) for i in train_index]
    test_images, test_labels = [images[i] for i in test_index], [int(digits.target[i]) for i in test_index]
    nll_data = [renderer.datum(images[i], int(digits.target[i])) for i in test_index[:args.num_nll_eval]]

    records = []
    metrics_file = (args.log_dir / "metrics.jsonl").open("w")

    def log(record: dict) -> None:
        record["elapsed_s"] = round(time.monotonic() - started, 2)
        records.append(record)
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        print(json.dumps(record), flush=True)

    rng = np.random.default_rng(args.seed + 1)
    batch_order = rng.permutation(len(train_data))
    cursor = 0
    for step in range(args.num_steps + 1):
        if step % args.eval_every == 0 or step == args.num_steps:
            log({"step": step, **evaluate(training.save_weights_and_get_sampling_client().result(), renderer,
                                          test_images, test_labels, nll_data)})
        if step == args.num_steps:
            break
        if cursor + args.batch_size > len(batch_order):
            batch_order, cursor = rng.permutation(len(train_data)), 0
        batch = [train_data[i] for i in batch_order[cursor:cursor + args.batch_size]]
        cursor += args.batch_size
        result = training.forward_backward(batch, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=args.learning_rate)).result()
        log({"step": step, "train_nll": mean_nll([o["logprobs"].tolist() for o in result.loss_fn_outputs], batch)})
    metrics_file.close()
    plot(records, args.log_dir / "metrics.png")


if __name__ == "__main__":
    main()
