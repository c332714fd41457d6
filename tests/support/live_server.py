"""A live server: `python -m server` in a subprocess on a free port, for the tests and the benchmarks.

The real `tinker` SDK talks to it over HTTP, exactly as a user's script would, with API keys got the
way users get them: the key the server prints on its first start, and keys an operator issues with
`python -m server keys create --tenant NAME` on the server's database.
"""

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import tinker
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE_MODEL = "builtin:tiny-qwen3"
STARTUP_SECONDS = 120
# The first start's banner shows the default tenant's key on a line of its own.
_BANNER_KEY = re.compile(r"^\s+(tml-[A-Za-z0-9_-]+)\s*$", re.MULTILINE)


class ServerFailedToStart(RuntimeError):
    """The server exited or did not answer healthz in time; the message ends with its log."""


@dataclass
class LiveServer:
    url: str
    data_dir: Path
    database_url: str | None
    process: subprocess.Popen
    log_path: Path
    api_key: str = ""
    """A key of the default tenant: the one the first start printed, else one issued for it."""

    def service_client(self, api_key: str | None = None) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=api_key or self.api_key)

    def headers(self, api_key: str | None = None) -> dict[str, str]:
        """Headers for raw HTTP calls."""
        return {"X-API-Key": api_key or self.api_key}

    def keys_command(self, *args: str) -> subprocess.CompletedProcess:
        """`python -m server keys ARGS` on this server's database, as its operator runs it."""
        database = ["--database-url", self.database_url] if self.database_url is not None else []
        return subprocess.run([sys.executable, "-m", "server", "keys", *args, "--data-dir", str(self.data_dir),
                               *database], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the server's Prometheus metrics, 0 when absent (read with `api_key`, an admin key
        when the first start printed it), matched by its labels whatever their order."""
        text = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {self.api_key}"}).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return 0.0

    def create_key(self, tenant: str, *, admin: bool = False) -> str:
        """Issue a new API key for `tenant`."""
        return self.keys_command("create", "--tenant", tenant, *(["--admin"] if admin else [])).stdout.strip()

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
                 port: int | None = None, environment: dict[str, str] | None = None) -> LiveServer:
    """Start `python -m server` on `base_model` and wait until it answers healthz.

    Args:
        database_url: None keeps the server's default (SQLite under `data_dir`).
        models_dir: a shared cache of built-in models, linked into `data_dir`; None builds them there.
        extra_args: more flags for its command line.
        environment: more variables for its environment (a multi-node rendezvous).
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    models_link = data_dir / "models"
    if models_dir is not None and not models_link.exists():
        models_link.symlink_to(models_dir, target_is_directory=True)
    port = port or free_port()
    log_path = data_dir / f"server-{port}.log"
    env = dict(os.environ, TINKER_TELEMETRY="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               **(environment or {}))
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
                printed = _BANNER_KEY.search(log_path.read_text())
                server.api_key = printed.group(1) if printed else server.create_key("default")
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise ServerFailedToStart(f"server did not come up in {startup_seconds} s:\n{server.log()}")
