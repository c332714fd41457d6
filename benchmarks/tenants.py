"""Many tenants on one server: aggregate training tokens/s and each tenant's step latency, with runs
sharing training passes (the default) against one run per pass (`--max-runs-per-pass 1`), side by side.

For each number of tenants (default 1, 4 and 8), every tenant (its own SDK client and LoRA run; the
scheduler shares passes by run, so one API key serves them all) sends RL-sized steps concurrently
through the tinker SDK: a forward_backward of 8 x 1,024 tokens (importance_sampling, the RL loss)
and an optim_step, then waits for both. One server per mode, both up at once (on a GPU their peaks
add up): after one warm-up step per tenant, the modes take turns, round by round (A B, B A, A B, ...,
`--rounds`, each `--steps` steps per tenant), so that what drifts over the run (clocks, the host's
load) weighs on both alike. Prints, per mode and tenant count, the aggregate tokens/s, the median and
worst tenant's median step latency, the server's peak memory (GPU: reserved by its allocator; CPU:
peak RSS), the mean seconds of a forward_backward's and of an optim_step's work on the training thread
(from the server's metrics: where a step's time goes), and the ratio batched / one-at-a-time with its
spread (each round's ratio: median, lowest, highest). With one tenant both modes run the same passes:
that ratio is a control, which shows how far the two server processes differ.

    python benchmarks/tenants.py --shape tiny --device cpu --dtype float32 --sequence-length 128 --steps 1 --rounds 2
    python benchmarks/tenants.py --shape 4b            # on a GPU (the model is written once, see train_throughput.py)

Goal on the GPU (the issue's): 8 tenants reach at least 2x the one-at-a-time aggregate throughput,
with no tenant's latency above twice its solo time.
"""

import argparse
import json
import re
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.train_throughput import BASE_NAME, SHAPES, write_model  # noqa: E402
from tests.support.live_server import LiveServer, start_server  # noqa: E402

MODES = {"batched": [], "one-at-a-time": ["--max-runs-per-pass", "1"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4b", choices=sorted(SHAPES))
    parser.add_argument("--tenants", default="1,4,8", help="comma-separated tenant counts")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sequences", type=int, default=8, help="datums per forward_backward")
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per mode, the modes alternating; at "
                        "least 5 for a figure to report")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per tenant in each round")
    parser.add_argument("--server-args", default="", help="more flags for both servers, e.g. '--compile'")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/train-throughput"))
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args()


def rl_data(args, seed: int):
    """One tenant's step: random plain-vocabulary ids, sampled logprobs and advantages (importance_sampling)."""
    from tinker import types

    rng = np.random.default_rng(seed)
    vocab = SHAPES[args.shape]["text"]["vocab_size"]
    low = min(1000, vocab // 2)  # the tokenizer's own (special) tokens are below 1000
    return [types.Datum(model_input=types.ModelInput.from_ints(rng.integers(low, vocab, args.sequence_length).tolist()),
                        loss_fn_inputs={"target_tokens": rng.integers(low, vocab, args.sequence_length).tolist(),
                                        "logprobs": (-rng.random(args.sequence_length) * 5).tolist(),
                                        "advantages": rng.normal(size=args.sequence_length).tolist()})
            for _ in range(args.sequences)]


def work_seconds(server: LiveServer) -> dict[str, tuple[float, int]]:
    """Seconds and count of the requests' work on the training thread, by request type (the server's
    tinker_request_seconds: from a request's first pass to its result; optim_step alone for OptimStep)."""
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.api_key}"}).text
    totals: dict[str, list[float]] = {}
    for kind, request_type, value in re.findall(
            r'^tinker_request_seconds_(sum|count)\{.*?request_type="(\w+)".*?\} (\S+)$', text, re.MULTILINE):
        totals.setdefault(request_type, [0.0, 0])[kind == "count"] += float(value)
    return {request_type: (total, int(count)) for request_type, (total, count) in totals.items()}


def peak_memory_gib(server: LiveServer, device: str) -> float:
    """The server's peak: reserved GPU memory (read now; the allocator keeps what it reached), or peak RSS."""
    if device == "cuda":
        text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.api_key}"}).text
        return sum(float(value) for value in
                   re.findall(r"^tinker_gpu_memory_reserved_bytes\{.*\} (\S+)$", text, re.MULTILINE)) / 2**30
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE).group(1)) / 2**20


def start_mode_server(args, mode: str, model_dir: Path) -> LiveServer:
    command = ["--model-path", str(model_dir), "--device", args.device, "--dtype", args.dtype, *MODES[mode],
               *args.server_args.split()]
    # A fresh data dir: on an old one the server prints no admin key, and /metrics (admin only) refuses.
    data_dir = args.work_dir / f"tenants-{args.shape}-{mode}"
    shutil.rmtree(data_dir, ignore_errors=True)
    return start_server(data_dir, None, None, *command, base_model=BASE_NAME.format(shape=args.shape),
                        startup_seconds=900)


def run_round(args, clients: list, data: list, steps: int) -> dict:
    """Every tenant steps `steps` times, all at once; returns aggregate tokens/s and each tenant's step seconds."""
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-5)
    latencies: list[list[float]] = [[] for _ in clients]
    barrier = threading.Barrier(len(clients) + 1)

    def tenant(index: int) -> None:
        try:
            barrier.wait()
            for _ in range(steps):
                started = time.perf_counter()
                forward_backward = clients[index].forward_backward(data[index], "importance_sampling")
                optim = clients[index].optim_step(adam)
                forward_backward.result()
                optim.result()
                latencies[index].append(time.perf_counter() - started)
        except BaseException:
            barrier.abort()  # the others (and the timer) must not wait for this tenant forever
            raise

    threads = [threading.Thread(target=tenant, args=(index,)) for index in range(len(clients))]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if any(len(times) < steps for times in latencies):
        raise RuntimeError("a tenant failed (its error is above)")
    return dict(tokens_per_s=len(clients) * steps * args.sequences * args.sequence_length / seconds,
                seconds=seconds, step_seconds=latencies)


def measure_count(args, servers: dict[str, LiveServer], num_tenants: int) -> dict[str, dict]:
    """One tenant count on every mode's server: a warm-up step, then the modes' rounds in turn."""
    base_model = BASE_NAME.format(shape=args.shape)
    data = [rl_data(args, seed) for seed in range(num_tenants)]
    clients, before = {}, {}
    for mode, server in servers.items():
        service = server.service_client()
        clients[mode] = [service.create_lora_training_client(base_model=base_model, rank=args.rank,
                                                             seed=index).result() for index in range(num_tenants)]
        before[mode] = work_seconds(server)
        run_round(args, clients[mode], data, steps=1)  # warm-up
    rounds: dict[str, list[dict]] = {mode: [] for mode in servers}
    for round_index in range(args.rounds):
        order = list(servers) if round_index % 2 == 0 else list(servers)[::-1]
        for mode in order:
            rounds[mode].append(run_round(args, clients[mode], data, args.steps))
    results = {}
    for mode, server in servers.items():
        # Mean seconds of each kind's work (warm-up steps included): where a step's time goes.
        after, mean_work = work_seconds(server), {}
        for kind in ("ForwardBackward", "OptimStep"):
            (seconds, number), (seconds_before, number_before) = after[kind], before[mode].get(kind, (0.0, 0))
            mean_work[kind] = (seconds - seconds_before) / (number - number_before)
        mode_rounds = rounds[mode]
        tokens = num_tenants * args.steps * args.sequences * args.sequence_length * len(mode_rounds)
        results[mode] = dict(
            tokens_per_s=tokens / sum(r["seconds"] for r in mode_rounds),
            round_tokens_per_s=[r["tokens_per_s"] for r in mode_rounds],
            tenant_median_step_s=[statistics.median(t for r in mode_rounds for t in r["step_seconds"][index])
                                  for index in range(num_tenants)],
            peak_memory_gib=peak_memory_gib(server, args.device), mean_work_s=mean_work)
        print(f"{mode}, {num_tenants} tenants: {results[mode]['tokens_per_s']:.0f} tokens/s", flush=True)
    return results


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "lowest": min(values), "highest": max(values),
            "rounds": len(values)}


def main() -> None:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = write_model(args.shape, args.work_dir / f"model-{args.shape}", args.device)
    modes = args.modes.split(",")
    servers: dict[str, LiveServer] = {}
    try:
        for mode in modes:  # one after the other: each loads the model alone
            servers[mode] = start_mode_server(args, mode, model_dir)
        by_count = {count: measure_count(args, servers, count) for count in map(int, args.tenants.split(","))}
    finally:
        for server in servers.values():
            server.stop(timeout=120)
    measured = {mode: {count: results[mode] for count, results in by_count.items()} for mode in modes}
    ratios = {}
    if {"batched", "one-at-a-time"} <= set(modes):
        for count, results in by_count.items():
            batched, alone = results["batched"], results["one-at-a-time"]
            ratios[count] = {"ratio": batched["tokens_per_s"] / alone["tokens_per_s"],
                             **spread([b / a for b, a in zip(batched["round_tokens_per_s"],
                                                             alone["round_tokens_per_s"])])}
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         **{mode: {str(k): v for k, v in results.items()}
                                            for mode, results in measured.items()},
                                         "ratios": {str(k): v for k, v in ratios.items()}}, indent=2))
    print(f"\n{args.shape}, {args.device} {args.dtype}: each tenant steps {args.sequences} x {args.sequence_length} "
          f"tokens (importance_sampling) + optim_step, LoRA rank {args.rank}; {args.rounds} rounds of {args.steps} "
          f"timed steps per mode, the modes alternating; server flags: {args.server_args or 'defaults'}")
    print(f"{'mode':14} {'tenants':>7} {'tokens/s':>10} {'round range':>15} {'median step s':>14} "
          f"{'worst step s':>13} {'worst/solo':>10} {'peak GiB':>9} {'fwd-bwd s':>10} {'optim s':>8}")
    for mode, results in measured.items():
        solo = statistics.median(results[min(results)]["tenant_median_step_s"])
        for count, result in results.items():
            steps, work, rates = result["tenant_median_step_s"], result["mean_work_s"], result["round_tokens_per_s"]
            print(f"{mode:14} {count:7d} {result['tokens_per_s']:10.0f} {f'{min(rates):.0f}-{max(rates):.0f}':>15} "
                  f"{statistics.median(steps):14.3f} {max(steps):13.3f} {max(steps) / solo:10.2f} "
                  f"{result['peak_memory_gib']:9.2f} {work['ForwardBackward']:10.3f} {work['OptimStep']:8.3f}")
    for count, ratio in ratios.items():
        control = " (a control: one tenant's passes are the same in both modes)" if count == 1 else ""
        print(f"{count} tenants: batched / one-at-a-time aggregate tokens/s = {ratio['ratio']:.2f} (round by round: "
              f"median {ratio['median']:.2f}, {ratio['lowest']:.2f}-{ratio['highest']:.2f} over {ratio['rounds']} "
              f"rounds){control}")
    if args.rounds < 5:
        print(f"only {args.rounds} rounds: a trial, not a figure to report (at least 5)")


if __name__ == "__main__":
    main()
