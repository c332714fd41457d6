"""A live server for the SDK tests: `python -m server` in a subprocess on a free port.

The real `tinker` SDK talks to it over HTTP, exactly as a user's script would.
"""

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import tinker

REPO_ROOT = Path(__file__).resolve().parents[1]
BASE_MODEL = "builtin:tiny-qwen3"
API_KEY = "tml-integration-tests"
STARTUP_SECONDS = 120


@dataclass
class LiveServer:
    url: str
    data_dir: Path
    database_url: str
    process: subprocess.Popen
    log_path: Path

    def service_client(self, api_key: str = API_KEY) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=api_key)

    def log(self) -> str:
        return self.log_path.read_text()[-5000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(data_dir: Path, database_url: str, models_dir: Path, *extra_args: str,
                 base_model: str = BASE_MODEL, startup_seconds: float = STARTUP_SECONDS) -> LiveServer:
    """Start `python -m server` on `base_model` and wait until it answers healthz (extra_args go to its
    command line)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    models_link = data_dir / "models"
    if not models_link.exists():
        models_link.symlink_to(models_dir, target_is_directory=True)
    port = _free_port()
    log_path = data_dir / f"server-{port}.log"
    env = dict(os.environ, TINKER_TELEMETRY="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "--base-model", base_model, "--port", str(port),
         "--data-dir", str(data_dir), "--database-url", database_url, *extra_args],
        cwd=REPO_ROOT, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    server = LiveServer(f"http://127.0.0.1:{port}", data_dir, database_url, process, log_path)
    deadline = time.monotonic() + startup_seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}:\n{server.log()}", pytrace=False)
        try:
            if httpx.get(f"{server.url}/api/v1/healthz", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    pytest.fail(f"server did not come up in {startup_seconds} s:\n{server.log()}", pytrace=False)
