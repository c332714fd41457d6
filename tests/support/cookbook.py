"""Running the unmodified tinker-cookbook recipes against a live server, as a user runs them, and reading
what they write (metrics.jsonl, checkpoints.jsonl).

A recipe starts in a working directory that holds the model under the hub name it asks for and the
datasets it loads, in the hub's layout: transformers and datasets read such relative directories
before the hub, so everything resolves offline.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from support.live_server import LiveServer


def link(name: Path, target: Path) -> None:
    """Make `name` (e.g. workdir/Qwen/Qwen3-8B) point at the model directory `target`."""
    name.parent.mkdir(parents=True, exist_ok=True)
    if not name.exists():
        name.symlink_to(target, target_is_directory=True)


def run_recipe(server: LiveServer, workdir: Path, module: str, *args: str, timeout: float = 300) -> str:
    """Run `python -m tinker_cookbook.recipes.<module> args...` as a user would; its output, or fail with it."""
    env = dict(os.environ, TINKER_BASE_URL=server.url, TINKER_API_KEY=server.api_key, TINKER_TELEMETRY="0",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(workdir / "hf-home"),
               TINKER_COOKBOOK_RUNS_DIR=str(workdir / "runs"))
    done = subprocess.run([sys.executable, "-m", f"tinker_cookbook.recipes.{module}", *args], cwd=workdir, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert done.returncode == 0, (f"{module} exited with {done.returncode}:\n{done.stdout[-8000:]}\n"
                                  f"--- server log ---\n{server.log()}")
    return done.stdout


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_all_finite(rows: list[dict]) -> None:
    bad = {(row.get("step"), key): value for row in rows for key, value in row.items()
           if isinstance(value, float) and not math.isfinite(value)}
    assert not bad, f"non-finite metrics: {bad}"
