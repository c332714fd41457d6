"""`python -m server` in a subprocess for the benchmarks that go through the API."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]


def start_server(args: list[str], log_path: Path, url: str, startup_seconds: float = 900) -> subprocess.Popen:
    """Start `python -m server ARGS` (output to log_path) and wait until `url` answers healthz."""
    server = subprocess.Popen([sys.executable, "-m", "server", *args], cwd=REPO_ROOT, stdout=log_path.open("w"),
                              stderr=subprocess.STDOUT, env=dict(os.environ, TINKER_TELEMETRY="0"))
    deadline = time.monotonic() + startup_seconds
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"server did not start:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
