"""A live server: `python -m server` in a subprocess on a free port, for the tests and the benchmarks.

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
import tinker

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE_MODEL = "builtin:tiny-qwen3"
API_KEY = "tml-integration-tests"
STARTUP_SECONDS = 120


class ServerFailedToStart(RuntimeError):
    """The server exited or did not answer healthz in time; the message ends with its log."""


@dataclass
class LiveServer:
    url: str
    data_dir: Path
    database_url: str | None
    process: subprocess.Popen
    log_path: Path

    def service_client(self, api_key: str = API_KEY) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=api_key)

    def log(self) -> str:
        return self.log_path.read_text()[-5000:]

    def stop(self, timeout: float = 30) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(data_dir: Path, database_url: str | None, models_dir: Path | None, *extra_args: str,
                 base_model: str = BASE_MODEL, startup_seconds: float = STARTUP_SECONDS,
                 port: int | None = None) -> LiveServer:
    """Start `python -m server` on `base_model` and wait until it answers healthz.

    Args:
        database_url: None keeps the server's default (SQLite under `data_dir`).
        models_dir: a shared cache of built-in models, linked into `data_dir`; None builds them there.
        extra_args: more flags for its command line.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    models_link = data_dir / "models"
    if models_dir is not None and not models_link.exists():
        models_link.symlink_to(models_dir, target_is_directory=True)
    port = port or free_port()
    log_path = data_dir / f"server-{port}.log"
    env = dict(os.environ, TINKER_TELEMETRY="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    database = ["--database-url", database_url] if database_url is not None else []
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "--base-model", base_model, "--port", str(port),
         "--data-dir", str(data_dir), *database, *extra_args],
        cwd=REPO_ROOT, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    server = LiveServer(f"http://127.0.0.1:{port}", data_dir, database_url, process, log_path)
    deadline = time.monotonic() + startup_seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerFailedToStart(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/api/v1/healthz", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise ServerFailedToStart(f"server did not come up in {startup_seconds} s:\n{server.log()}")
