"""Prove it learns: the digits classifier script, run as a user would against a live server, reaches
at least 90 % held-out greedy accuracy on a built-in tiny Qwen2-VL in 300 steps. The
time is printed, not asserted: a loaded machine takes longer, and the deadline only guards against a hang."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from support.live_server import start_server

SCRIPT = Path(__file__).with_name("digits_classifier.py")
HANG_GUARD_SECONDS = 60 * 60


def test_a_tiny_vlm_learns_to_read_digits_through_the_sdk(models_dir, tmp_path):
    server = start_server(tmp_path / "server", f"sqlite:///{tmp_path}/server.db", models_dir,
                          base_model="builtin:tiny-qwen2-vl")
    log_dir = tmp_path / "digits"
    started = time.monotonic()
    try:
        run = subprocess.run([sys.executable, str(SCRIPT), "--base-url", server.url, "--log-dir", str(log_dir)],
                             env=dict(os.environ, TINKER_API_KEY=server.api_key, TINKER_TELEMETRY="0"),
                             capture_output=True, text=True, timeout=HANG_GUARD_SECONDS)
    finally:
        server.stop()
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "accuracy" in r]
    train = [r for r in records if "train_nll" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == train[-1]["step"] + 1
    # Before training the random model knows no digit; after it, at least 9 in 10 held-out digits.
    assert evals[0]["accuracy"] < 0.2
    assert evals[-1]["accuracy"] >= 0.9, evals
    assert evals[-1]["held_out_nll"] < 0.5 * evals[0]["held_out_nll"]
    assert sum(r["train_nll"] for r in train[-20:]) < 0.2 * sum(r["train_nll"] for r in train[:20])
    assert (log_dir / "metrics.png").stat().st_size > 10_000
    print(f"digits: held-out accuracy {evals[-1]['accuracy']:.3f} after {evals[-1]['step']} steps, {elapsed:.0f} s")
