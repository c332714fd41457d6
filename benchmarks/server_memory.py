"""The server's own memory over thousands of requests: it must stay flat (no unbounded caches,
futures, sessions or snapshots).

    python -m benchmarks.server_memory [--rounds 600] [--family qwen2-vl]

Starts `python -m server` on a built-in tiny VLM (embedded sampler, SQLite) and drives it with the
tinker SDK. Each round, as an RL loop would: forward_backward on an image prompt (a new image every
round, so the image caches fill and must evict), optim_step, save_weights_and_get_sampling_client
(a new sampling session and snapshot every round), sample with 2 samples, compute_logprobs; every
tenth round also a named save_weights_for_sampler and another tenant that trains once and leaves.
Prints the server's RSS (its whole process tree) at checkpoints, and the growth over the second
half of the run, when every bounded cache is full.
"""

import argparse
import tempfile
import time
from pathlib import Path

import tinker
from tinker import types

from benchmarks.process_memory import process_tree, rss_mib
from client_compat.images import ImageChunker
from tests.support.live_server import start_server
from tests.support.vision import noise_image


class Prompts:
    def __init__(self, training: tinker.TrainingClient, image_size: int):
        self.tokenizer = training.get_tokenizer()
        self.image_size = image_size
        self.chunker = ImageChunker(training.get_info().model_data.tokenizer_id)

    def prompt(self, seed: int) -> types.ModelInput:
        encode = self.tokenizer.encode
        return types.ModelInput(chunks=[
            types.EncodedTextChunk(tokens=encode("<|im_start|>user\n<|vision_start|>")),
            self.chunker.chunk(noise_image(self.image_size, self.image_size, seed)),
            types.EncodedTextChunk(tokens=encode("<|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"))])

    def datum(self, seed: int) -> types.Datum:
        prompt = self.prompt(seed)
        answer = self.tokenizer.encode(f"Noise number {seed}.<|im_end|>")
        model_input = prompt.append(types.EncodedTextChunk(tokens=answer[:-1]))
        targets = [0] * (prompt.length - 1) + answer
        weights = [0.0] * (prompt.length - 1) + [1.0] * len(answer)
        return types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": targets, "weights": weights})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2-vl", help="built-in tiny VLM family")
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--image-cache-mb", type=int, default=32)
    parser.add_argument("--feature-cache-mb", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="server-memory-"))
    base_model = f"builtin:tiny-{args.family}"
    # Small image caches, so that they fill early in the run and the second half shows the steady state.
    server = start_server(work_dir, None, None, "--image-cache-mb", str(args.image_cache_mb),
                          "--feature-cache-mb", str(args.feature_cache_mb), base_model=base_model,
                          startup_seconds=900)
    rows = []
    requests = 0
    try:
        service = server.service_client()
        training = service.create_lora_training_client(base_model=base_model, rank=8, seed=0).result()
        prompts = Prompts(training, args.image_size)
        params = types.SamplingParams(max_tokens=8, temperature=1.0)
        adam = types.AdamParams(learning_rate=1e-4)
        started = time.perf_counter()
        for index in range(args.rounds):
            datum = prompts.datum(index)
            forward_backward = training.forward_backward([datum], "cross_entropy")
            optim = training.optim_step(adam)
            forward_backward.result()
            optim.result()
            sampler = training.save_weights_and_get_sampling_client().result()
            sampler.sample(prompts.prompt(index), num_samples=2, sampling_params=params).result()
            sampler.compute_logprobs(datum.model_input).result()
            # HTTP requests besides future polls: forward_backward, optim_step, save, create sampling
            # session, sample, compute_logprobs.
            requests += 6
            if index % 10 == 9:
                training.save_weights_for_sampler(f"round-{index}").result()
                other = server.service_client(api_key=server.create_key(f"tenant-{index}"))
                other.create_lora_training_client(base_model=base_model, rank=4).result() \
                    .forward_backward([datum], "cross_entropy").result()
                other.close("success").result()  # ends its session: the server unloads its run
                requests += 5  # save_weights_for_sampler, create_session, create_model, forward_backward, finish
            if index == 0 or (index + 1) % max(1, args.rounds // 10) == 0:
                rss = rss_mib(process_tree(server.process.pid))
                rows.append((index + 1, requests, time.perf_counter() - started, rss))
                print(f"round {index + 1}: {requests} requests, RSS {rows[-1][3]:.0f} MiB", flush=True)
    finally:
        server.stop(timeout=120)

    print(f"\ntiny {args.family}, embedded sampler, SQLite, --image-cache-mb {args.image_cache_mb} "
          f"--feature-cache-mb {args.feature_cache_mb}; one new {args.image_size}x{args.image_size} image per round\n")
    print("| rounds | requests | seconds | server RSS (MiB) |")
    print("|---|---|---|---|")
    for round_number, count, seconds, rss in rows:
        print(f"| {round_number} | {count} | {seconds:.0f} | {rss:.0f} |")
    middle = rows[len(rows) // 2]
    last = rows[-1]
    print(f"\nsecond half: {last[3] - middle[3]:+.0f} MiB over {last[1] - middle[1]} requests "
          f"({(last[3] - middle[3]) / (last[1] - middle[1]) * 1024:+.1f} KiB per request)")


if __name__ == "__main__":
    main()
