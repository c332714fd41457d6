"""Short sampling requests, the shape of multi-turn RL: many one-sample requests against one many-sample request.

    python -m benchmarks.rollout                                   (CPU: builtin:tiny-qwen2-vl, float32)
    python -m benchmarks.rollout --device cuda --dtype bfloat16 --requests 256
    python -m benchmarks.rollout --device cuda --dtype bfloat16 --requests 256 --sides server,server-eager
    python -m benchmarks.rollout --sides server,server-vllm,raw-vllm --vllm-python .venv-vllm/bin/python
    python -m benchmarks.rollout --sides grid-walk --base-model builtin:smollm2-135m-qwen2-vl --device cuda \
        --dtype bfloat16 --walk-steps 6

The cookbook's RL loop samples each episode's next turn on its own: one request per episode per turn,
`num_samples=1`, a handful of new tokens. For each prompt shape (0, 1 or 4 images) every side runs:
- idle: one request at a time, `--idle` of them: the latency of a request on an idle server;
- burst: `--requests` one-sample requests at once, each with its own prompt text and images (as an RL
  step's episodes have), from one client process or split over `--clients`: requests/s and the p50/p99
  latency of a request;
- one request of `--requests` samples of one prompt: what the engine costs for as many samples.
The ratio burst / one is what a request costs beyond its sample; 1.0 is the engine's own speed.

Sides: `server` (python -m server, embedded engine, driven by the tinker SDK), `server-eager` (the same
with `--sampler-cuda-graphs off`: on a CUDA device, decode steps run eagerly instead of replayed as CUDA graphs), `server-vllm`
(python -m server --sampler vllm, the SDK), `raw-vllm` (vLLM's own OpenAI server started with the
flags the server gives its vLLM, driven over HTTP by one asyncio client, no server of ours). Every side
samples a LoRA adapter of rank 8 (raw-vllm loads the one a server side saved), or with `--sample base` the
base model: the same work on both sides of server-vllm / raw-vllm either way. Peak memory is the RSS of each
side's process tree (CPU) or the GPU memory in use.

The side `grid-walk` is a multi-turn VLM RL step as users run one: the grid walk
(client_compat/examples/grid_walk.py) through the cookbook's RL loop, `--walk-groups` grids x
`--walk-group-size` attempts x up to 4 turns, each turn a one-sample request with a new picture. It
prints each step's time, the part of it spent sampling, and the share of the sampling prompts'
positions the engine took from its prefix cache instead of running them. Speed is never asserted in
tests; record results in RESULTS.md with the machine and date.
"""

import argparse
import asyncio
import base64
import dataclasses
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.process_memory import PeakMemory, process_tree  # noqa: E402
from tests.support.live_server import start_server  # noqa: E402

BASE_MODEL = "builtin:tiny-qwen2-vl"
PROMPT_TOKENS = 32
IMAGE_SIZE = 112


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--base-model", default=BASE_MODEL)
    parser.add_argument("--requests", type=int, default=128, help="one-sample requests in a burst")
    parser.add_argument("--idle", type=int, default=20, help="requests one at a time, for the idle latency")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--images", default="0,1,4", help="images per prompt, one shape each")
    parser.add_argument("--rounds", type=int, default=2, help="timed bursts per shape (after one untimed)")
    parser.add_argument("--clients", type=int, default=1,
                        help="client processes a burst is split over (each its own SDK client), as many users send "
                             "at once; 1 is one RL loop's process")
    parser.add_argument("--client", choices=["sdk", "http"], default="sdk",
                        help="how the --clients processes send a burst: the tinker SDK, or plain HTTP (httpx, the "
                             "SDK's own request bodies, asample then retrieve_future) to measure the server without "
                             "the SDK's own cost per request")
    parser.add_argument("--sides", default="server")
    parser.add_argument("--sample", choices=["adapter", "base"], default="adapter",
                        help="what every side samples: a LoRA adapter of rank 8 (as an RL loop does; raw-vllm loads the "
                             "one a server side saved), or the base model")
    parser.add_argument("--server-args", default="", help="more flags for python -m server")
    parser.add_argument("--vllm-python", type=Path, default=REPO_ROOT / ".venv-vllm" / "bin" / "python")
    parser.add_argument("--walk-steps", type=int, default=6, help="grid-walk RL steps (the first is not counted)")
    parser.add_argument("--walk-groups", type=int, default=32, help="grids per grid-walk step")
    parser.add_argument("--walk-group-size", type=int, default=8, help="attempts per grid")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/rollout-bench"))
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args()


def prompt_text(tokenizer, index: int) -> list[int]:
    """About PROMPT_TOKENS tokens of plain text (never a special or placeholder token), its end its own."""
    words = " ".join(["Walk to the square that the picture marks, one step at a time."] * 4)
    return tokenizer.encode(words)[:PROMPT_TOKENS - 8] + tokenizer.encode(f" Episode {index}:")


def make_images(count: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)) for _ in range(count)]


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class Timed:
    """Latencies of requests, and the wall time of the whole batch of them."""

    def __init__(self):
        self.latencies: list[float] = []

    async def run(self, make, count: int) -> float:
        async def one(index: int):
            start = time.perf_counter()
            await make(index)
            self.latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(one(index) for index in range(count)))
        return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main_thread_seconds(pid: int) -> float:
    """CPU seconds the process's main thread has run (the server's event loop: its HTTP front); Linux only."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def measure(args, num_images: int, send_one, send_many, burst=None, server_pid: int | None = None) -> dict:
    """idle, burst and one-many-sample timings of one prompt shape, through `send_one(index)` and `send_many(n)`;
    `burst(round)`, when given, runs a round's burst elsewhere and returns (seconds, latencies). With
    `server_pid`, also the server's event loop's CPU per request over the timed bursts."""
    await send_many(4)  # untimed: the engine loads its model copy on its first request
    idle = Timed()
    for index in range(args.idle):
        await idle.run(lambda _, index=index: send_one(10_000_000 + index), 1)
    bursts, front_seconds = [], 0.0
    for round_index in range(args.rounds + 1):
        front_before = main_thread_seconds(server_pid) if server_pid is not None and round_index else 0.0
        if burst is not None:
            bursts.append(await asyncio.to_thread(burst, round_index))
        else:
            timed = Timed()
            seconds = await timed.run(lambda index: send_one(round_index * args.requests + index), args.requests)
            bursts.append((seconds, timed.latencies))
        if server_pid is not None and round_index:
            front_seconds += main_thread_seconds(server_pid) - front_before
    many = []
    for _ in range(args.rounds + 1):
        start = time.perf_counter()
        await send_many(args.requests)
        many.append(time.perf_counter() - start)
    burst_seconds = statistics.median(seconds for seconds, _ in bursts[1:])
    latencies = [latency for _, round_latencies in bursts[1:] for latency in round_latencies]
    many_seconds = statistics.median(many[1:])
    return {"images": num_images, "idle_p50_ms": 1000 * percentile(idle.latencies, 50),
            "burst_seconds": burst_seconds, "requests_per_second": args.requests / burst_seconds,
            "p50_ms": 1000 * percentile(latencies, 50), "p99_ms": 1000 * percentile(latencies, 99),
            "many_seconds": many_seconds, "ratio": burst_seconds / many_seconds,
            "front_cpu_ms_per_request": 1000 * front_seconds / (args.rounds * args.requests)}


class Prompts:
    """Each request's own prompt: plain text that ends with its index, and its own images."""

    def __init__(self, tokenizer, chunker):
        self.tokenizer, self.chunker = tokenizer, chunker
        self.vision = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
        self.images = {}

    def build(self, index: int, num_images: int):
        from tinker import types

        chunks = [types.EncodedTextChunk(tokens=prompt_text(self.tokenizer, index))]
        for image_index in range(num_images):
            key = (index, image_index)
            if key not in self.images:
                self.images[key] = self.chunker.chunk(make_images(1, hash(key) % 2**32)[0])
            chunks += [types.EncodedTextChunk(tokens=[self.vision[0]]), self.images[key],
                       types.EncodedTextChunk(tokens=[self.vision[1]])]
        return types.ModelInput(chunks=chunks)


def client_process(url: str, api_key: str, sampled: dict[str, str], model_dir: str, num_images: int,
                   indices: list[int], max_tokens: int, client: str, ready, go, results) -> None:
    """One of --clients processes: its own SDK client (or plain HTTP client) sends its share of a burst once all
    are ready."""
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    from client_compat.images import ImageChunker

    service = tinker.ServiceClient(base_url=url, api_key=api_key)
    sampler = service.create_sampling_client(**sampled).result()
    prompts = Prompts(AutoTokenizer.from_pretrained(model_dir), ImageChunker(model_dir))
    inputs = [prompts.build(index, num_images) for index in indices]
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])
    warm_up = prompts.build(10_000_000 + indices[0], num_images)
    sampler.sample(warm_up, num_samples=1, sampling_params=params).result()  # connected and warm
    if client == "http":
        send = http_sender(url, api_key, sampler._sampling_session_id, inputs, params, len(inputs))
    else:
        send = lambda index: sampler.sample(inputs[index], num_samples=1, sampling_params=params)  # noqa: E731
    ready.put(None)
    go.wait()
    timed = Timed()
    seconds = asyncio.run(timed.run(send, len(inputs)))
    results.put((seconds, timed.latencies))


def http_sender(url: str, api_key: str, sampling_session_id: str, inputs, params, concurrency: int):
    """send(index) for plain HTTP: the body the SDK would send (its own serialisation) to asample, then
    retrieve_future until the result is there; one connection per request in flight, as the SDK keeps."""
    import httpx
    from tinker import types
    from tinker._compat import model_dump

    bodies = [json.dumps(model_dump(types.SampleRequest(
        sampling_session_id=sampling_session_id, seq_id=1_000_000 + index, num_samples=1, prompt=prompt,
        sampling_params=params), exclude_unset=False, exclude_none=True, mode="json")).encode()
        for index, prompt in enumerate(inputs)]
    headers = {"X-API-Key": api_key, "Content-Type": "application/json"}
    clients = {}

    async def send(index: int) -> None:
        loop = asyncio.get_running_loop()
        if loop not in clients:  # made on the loop that uses it
            # Idle connections dropped before the server's keep-alive of 5 s drops them (httpx's default is 5 s
            # too: a request sent as the server closes its connection fails with ReadError).
            clients[loop] = httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=httpx.Limits(
                max_connections=2 * concurrency, keepalive_expiry=2))
        client = clients[loop]
        response = await client.post("/api/v1/asample", content=bodies[index])
        response.raise_for_status()
        request_id = response.json()["request_id"]
        while (response := await client.post("/api/v1/retrieve_future", json={"request_id": request_id})
               ).status_code == 408:
            pass
        response.raise_for_status()
        if response.headers["content-type"].startswith("application/json"):  # a sample's result is protobuf
            raise RuntimeError(f"sample request failed: {response.text}")

    return send


def burst_from_processes(args, server, sampled: dict[str, str], model_dir: str, num_images: int,
                         round_index: int) -> tuple[float, list[float]]:
    """A round's burst split over --clients processes that start together; (the slowest's seconds, latencies)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready, go, results = context.Queue(), context.Event(), context.Queue()
    first = round_index * args.requests
    processes = [context.Process(target=client_process, args=(
        server.url, server.api_key, sampled, model_dir, num_images,
        list(range(first + client, first + args.requests, args.clients)), args.max_tokens, args.client, ready, go,
        results))
        for client in range(args.clients)]
    for process in processes:
        process.start()
    for _ in processes:
        ready.get()
    go.set()
    outcomes = [results.get() for _ in processes]
    for process in processes:
        process.join()
    return max(seconds for seconds, _ in outcomes), [latency for _, latencies in outcomes for latency in latencies]


def run_server(args, side: str) -> dict:
    """One of the server's sides, driven by the tinker SDK as the cookbook's RL loop drives it."""
    import tinker
    from tinker import types

    from client_compat.images import ImageChunker

    flags = ["--device", args.device, "--dtype", args.dtype, *args.server_args.split()]
    if side == "server-vllm":
        flags += ["--sampler", "vllm", "--vllm-python", str(args.vllm_python)]
    if side == "server-eager":
        flags += ["--sampler-cuda-graphs", "off"]
    server = start_server(args.work_dir / side, None, args.work_dir / "models", *flags, base_model=args.base_model,
                          startup_seconds=1800)
    try:
        service = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
        training = service.create_lora_training_client(base_model=args.base_model, rank=8).result()
        tokenizer = training.get_tokenizer()
        chunker = ImageChunker(training.get_info().model_data.tokenizer_id)
        # The sampling client's arguments: a saved adapter's path, or the base model's name.
        sampled = ({"model_path": training.save_weights_for_sampler("rollout").result().path}
                   if args.sample == "adapter" else {"base_model": args.base_model})
        sampler = service.create_sampling_client(**sampled).result()
        prompts = Prompts(tokenizer, chunker)
        prompt = prompts.build

        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])
        results = []
        with PeakMemory(args.device, lambda: process_tree(server.process.pid)) as memory:
            for num_images in [int(count) for count in args.images.split(",")]:
                for index in range(args.rounds * args.requests + args.requests):
                    prompt(index, num_images)  # built before timing: the client's own work is not measured

                async def send_one(index: int, num_images=num_images):
                    await sampler.sample(prompt(index, num_images), num_samples=1, sampling_params=params)

                burst = None
                if args.clients > 1 or args.client == "http":
                    burst = lambda round_index, num_images=num_images: burst_from_processes(  # noqa: E731
                        args, server, sampled, training.get_info().model_data.tokenizer_id, num_images,
                        round_index)

                async def send_many(count: int, num_images=num_images):
                    await sampler.sample(prompt(0, num_images), num_samples=count, sampling_params=params)

                results.append(asyncio.run(measure(args, num_images, send_one, send_many, burst, server.process.pid)))
                prompts.images.clear()
                print(f"{side}: {results[-1]}", flush=True)
        service.close("success").result()
        return {"shapes": results, "peak_memory_gib": memory.peak}
    finally:
        server.stop(timeout=120)


def run_raw_vllm(args) -> dict:
    """vLLM's OpenAI server alone, with the flags the server gives its vLLM, driven over HTTP by asyncio."""
    import subprocess

    import httpx

    from server.config import parse_config
    from server.sampling.vllm_process import ServedModel, vllm_command, vllm_environment
    from tests.support.live_server import free_port

    model_dir = args.work_dir / "models" / args.base_model.removeprefix("builtin:")
    if not model_dir.exists():  # built by a server side's first start
        raise SystemExit(f"no {model_dir}: run a server side first (--sides server,raw-vllm)")
    config = parse_config(["--base-model", args.base_model, "--sampler", "vllm", "--device", args.device,
                           "--dtype", args.dtype, "--vllm-python", str(args.vllm_python)])
    port = free_port()
    served = ServedModel(directory=model_dir, name=args.base_model, dtype=args.dtype, refused_token_ids=frozenset(),
                         max_images_per_prompt=config.sampler.max_images_per_prompt)
    # As the server does: vLLM refuses a context longer than the model's positions.
    positions = json.loads((model_dir / "config.json").read_text())
    positions = positions.get("text_config", positions).get("max_position_embeddings")
    vllm_config = dataclasses.replace(config.sampler.vllm, max_model_len=min(config.sampler.vllm.max_model_len,
                                                                           positions or config.sampler.vllm.max_model_len))
    command = vllm_command(vllm_config, served, port)
    model = args.base_model
    if args.sample == "adapter":  # the adapter a server side saved, loaded by vLLM at start
        saved = sorted(args.work_dir.glob("server*/**/adapter_config.json"), key=lambda path: path.stat().st_mtime)
        if not saved:
            raise SystemExit(f"no saved adapter under {args.work_dir}: run a server side first, or --sample base")
        model = "rollout"
        command += ["--lora-modules", f"{model}={saved[-1].parent}"]
    log = (args.work_dir / "raw-vllm.log").open("w")
    process = subprocess.Popen(command, env=vllm_environment(vllm_config), stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1800
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"vLLM did not start; see {args.work_dir / 'raw-vllm.log'}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)

        results = []
        with PeakMemory(args.device, lambda: process_tree(process.pid)) as memory:
            for num_images in [int(count) for count in args.images.split(",")]:
                urls = {}

                def body(index: int, num_samples: int, num_images=num_images) -> tuple[str, dict]:
                    ids = prompt_text(tokenizer, index)
                    common = {"model": model, "max_tokens": args.max_tokens, "n": num_samples,
                              "temperature": 1.0, "ignore_eos": True}
                    if num_images == 0:
                        return "/v1/completions", {**common, "prompt": ids}
                    content = [{"type": "text", "text": tokenizer.decode(ids)}]
                    for image_index in range(num_images):
                        key = (index, image_index)
                        if key not in urls:
                            encoded = base64.b64encode(png(make_images(1, hash(key) % 2**32)[0])).decode()
                            urls[key] = f"data:image/png;base64,{encoded}"
                        content.append({"type": "image_url", "image_url": {"url": urls[key]}})
                    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": content}]}

                for index in range(args.rounds * args.requests + args.requests):
                    body(index, 1)

                async def shape(num_images=num_images):
                    limits = httpx.Limits(max_connections=args.requests, max_keepalive_connections=args.requests)
                    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
                        async def send(index: int, num_samples: int):
                            path, payload = body(index, num_samples, num_images)
                            response = await client.post(path, json=payload)
                            response.raise_for_status()

                        return await measure(args, num_images, lambda index: send(index, 1),
                                             lambda count: send(0, count))

                results.append(asyncio.run(shape()))
                print(f"raw-vllm: {results[-1]}", flush=True)
        return {"shapes": results, "peak_memory_gib": memory.peak}
    finally:
        import os
        import signal

        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=120)


def run_grid_walk(args) -> dict:
    """(c): the grid walk's RL steps through the cookbook's loop, against `python -m server`."""
    import os
    import subprocess

    from server.models.builtin import ensure_builtin_model

    flags = ["--device", args.device, "--dtype", args.dtype, *args.server_args.split()]
    server = start_server(args.work_dir / "grid-walk", None, args.work_dir / "models", *flags,
                          base_model=args.base_model, startup_seconds=1800)
    log = args.work_dir / "grid-walk" / "run"
    try:
        with PeakMemory(args.device, lambda: process_tree(server.process.pid)) as memory:
            env = dict(os.environ, TINKER_API_KEY=server.api_key, TINKER_TELEMETRY="0",
                       PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
            model = args.base_model.removeprefix("builtin:")
            done = subprocess.run(
                [sys.executable, "-m", "client_compat.examples.grid_walk", f"model_name={args.base_model}",
                 f"model_dir={ensure_builtin_model(model, args.work_dir / 'models')}", f"base_url={server.url}",
                 f"log_path={log}", f"batch_size={args.walk_groups}", f"group_size={args.walk_group_size}",
                 "max_turns=4", "max_tokens=4", f"max_steps={args.walk_steps}", "learning_rate=1e-3",
                 "lora_rank=32"], env=env, capture_output=True, text=True, cwd=args.work_dir)
            if done.returncode != 0:
                raise SystemExit(done.stdout[-3000:] + done.stderr[-5000:])
        rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
        steps = [{"step": row["step"], "seconds": row["time/total"], "sampling": row["time/sampling"],
                  "episodes": row["env/all/total_episodes"], "turns": row["env/all/turns_per_episode"]}
                 for row in rows if "time/total" in row and "time/sampling" in row]
        cached = server.metric("tinker_tokens_total", kind="prompt_cached")
        computed = server.metric("tinker_tokens_total", kind="prompt_computed")
        return {"steps": steps, "prompt_cached": cached, "prompt_computed": computed,
                "peak_memory_gib": memory.peak}
    finally:
        server.stop(timeout=120)


def print_walk(result: dict) -> None:
    print("\n| step | seconds | sampling s | sampling share | episodes | turns per episode |")
    print("|---|---|---|---|---|---|")
    for step in result["steps"]:
        print(f"| {step['step']} | {step['seconds']:.2f} | {step['sampling']:.2f} | "
              f"{step['sampling'] / step['seconds']:.0%} | {step['episodes']:.0f} | {step['turns']:.2f} |")
    timed = result["steps"][1:]  # the first step warms up
    seconds = statistics.median(step["seconds"] for step in timed)
    share = statistics.median(step["sampling"] / step["seconds"] for step in timed)
    positions = result["prompt_cached"] + result["prompt_computed"]
    print(f"\nmedian step {seconds:.2f} s, sampling {share:.0%} of it; prompt positions from the prefix cache: "
          f"{result['prompt_cached'] / max(positions, 1):.0%} of {positions:.0f}; peak memory "
          f"{result['peak_memory_gib']:.2f} GiB")


def print_table(results: dict) -> None:
    print("\n| side | images | idle p50 ms | burst s | requests/s | p50 ms | p99 ms | one request of N samples s "
          "| burst / one | front CPU ms per request | peak memory GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for side, result in results.items():
        for shape in result["shapes"]:
            print(f"| {side} | {shape['images']} | {shape['idle_p50_ms']:.1f} | {shape['burst_seconds']:.2f} | "
                  f"{shape['requests_per_second']:.0f} | {shape['p50_ms']:.0f} | {shape['p99_ms']:.0f} | "
                  f"{shape['many_seconds']:.2f} | {shape['ratio']:.1f} | {shape.get('front_cpu_ms_per_request', float('nan')):.2f} | "
                  f"{result['peak_memory_gib']:.2f} |")


def main() -> None:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    (args.work_dir / "models").mkdir(exist_ok=True)
    results = {}
    for side in args.sides.split(","):
        runs = {"raw-vllm": run_raw_vllm, "grid-walk": run_grid_walk}
        results[side] = runs[side](args) if side in runs else run_server(args, side)
    print(f"\n{args.base_model} on {args.device} ({args.dtype})")
    if "grid-walk" in results:
        print_walk(results["grid-walk"])
    requests = {side: result for side, result in results.items() if side != "grid-walk"}
    if requests:
        print(f"\n{args.requests} requests of {args.max_tokens} new tokens; every side samples "
              f"{'a LoRA adapter of rank 8' if args.sample == 'adapter' else 'the base model'}")
        print_table(requests)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()
