"""What the server tells its operator: the banner, the ready line and the progress of long steps."""

import asyncio
import io
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from server import app as app_module
from server import progress
from server.__main__ import bind
from server.banner import ready_line, server_url, start_banner
from server.config import parse_config
from server.training.parallel import init_training_group


def test_the_banner_names_address_model_engines_data_and_the_first_key(tmp_path):
    config = parse_config(["--base-model", "builtin:tiny-qwen2-vl", "--data-dir", str(tmp_path), "--port", "9123",
                           "--database-url", "postgresql+psycopg://tinker:secret@db/tinker"])
    banner = start_banner(config, tmp_path / "models" / "m", "qwen2_vl", "tml-abc", "default", "replicate")
    for shown in ("http://127.0.0.1:9123", "builtin:tiny-qwen2-vl", "qwen2_vl", "LoRA on cpu", "embedded",
                  str(tmp_path), "/dashboard", "/api/v1/healthz", "tml-abc",
                  "export TINKER_BASE_URL=http://127.0.0.1:9123 TINKER_API_KEY=tml-abc"):
        assert shown in banner
    assert "secret" not in banner  # the journal's URL without its password
    again = start_banner(config, tmp_path, "qwen2_vl", None, "default", "replicate")
    assert "tml-" not in again and "keys create" in again
    assert "base " not in again  # one rank: nothing to shard or replicate
    ranks = parse_config(["--base-model", "m", "--data-dir", str(tmp_path), "--gpus", "2"])
    assert "2 rank(s), base replicated" in start_banner(ranks, tmp_path, "qwen2_vl", None, "default", "replicate")
    assert "2 rank(s), base sharded (FSDP2)" in start_banner(ranks, tmp_path, "qwen2_vl", None, "default", "shard")


def test_a_wildcard_bind_is_announced_at_a_url_clients_can_use():
    config = parse_config(["--base-model", "m", "--host", "0.0.0.0", "--port", "8000"])
    assert server_url(config) == "http://127.0.0.1:8000"
    assert ready_line(config, 4.25).startswith("Ready: serving m at http://127.0.0.1:8000 (started in 4.2 s)")


def test_connections_to_the_listening_socket_send_small_writes_at_once():
    """Nagle's algorithm off on every accepted connection: with it on, a response's body waited for the
    client's delayed ACK of its headers (40 ms a request)."""
    listening = bind("127.0.0.1", 0)

    async def accepted_nodelay() -> int:
        nodelay = asyncio.get_running_loop().create_future()

        def accept(reader, writer):
            nodelay.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accept, sock=listening)
        _, writer = await asyncio.open_connection(*listening.getsockname())
        value = await nodelay
        writer.close()
        server.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


def test_off_a_terminal_a_long_step_is_log_lines_while_it_runs(monkeypatch, caplog):
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    monkeypatch.setattr(progress, "LOG_EVERY_SECONDS", 0.01)
    caplog.set_level(logging.INFO, logger="test.progress")
    with progress.Progress("vllm_start", "Starting vLLM", logging.getLogger("test.progress"), url="http://x") as step:
        step.note("Loading weights took 3 s")
        deadline = time.monotonic() + 10
        while not any("_progress" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0] == "event=vllm_start_started url=http://x"
    assert any(line.startswith("event=vllm_start_progress url=http://x seconds=") and "Loading weights" in line
               for line in lines[1:])


def test_a_short_step_with_a_delay_leaves_no_line(monkeypatch, caplog):
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    caplog.set_level(logging.INFO)
    with progress.Progress("checkpoint_save", "Saving", logging.getLogger("test.progress"), delay=2.0):
        pass
    assert not caplog.records


def test_on_a_terminal_a_long_step_is_a_bar_redrawn_in_place(monkeypatch, caplog):
    terminal = io.StringIO()
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    monkeypatch.setattr(progress.sys, "stderr", terminal)
    caplog.set_level(logging.INFO)
    with progress.Progress("model_load", "Loading m", logging.getLogger("test.progress"), total=100) as step:
        step.advance(40)
        step._bar.refresh()
    assert "Loading m" in terminal.getvalue() and "\r" in terminal.getvalue() and "40" in terminal.getvalue()
    assert not caplog.records  # drawn, not logged


def test_a_models_loading_is_reported(monkeypatch, caplog, models_dir: Path):
    from server.config import ModelConfig
    from server.models.loading import load_base_model

    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    caplog.set_level(logging.INFO, logger="server.models.loading")
    load_base_model(ModelConfig(base_model="builtin:tiny-qwen3", model_path=None, model_cache_dir=models_dir))
    assert [r.getMessage() for r in caplog.records][0].startswith("event=model_load_started base_model=builtin:tiny")


def test_a_start_up_refused_for_what_the_operator_gave_is_one_line(tmp_path):
    command = [sys.executable, "-m", "server", "--base-model", "acme/not-a-model", "--data-dir", str(tmp_path),
               "--port", "0"]
    quiet = subprocess.run(command, capture_output=True, text=True, timeout=300)
    reason = "'acme/not-a-model' is neither builtin:... nor in the local hub cache; pass --model-path DIR"
    assert quiet.returncode != 0
    assert f"ERROR:    {reason} (--debug prints the traceback)" in quiet.stderr
    assert "Traceback" not in quiet.stderr and "Traceback" not in quiet.stdout


@pytest.mark.parametrize("debug", [False, True])
def test_with_debug_a_refused_start_up_keeps_its_traceback(debug):
    def refuse(config, metrics):
        raise ValueError("no such model")

    app = app_module.create_app(parse_config(["--base-model", "m", *(["--debug"] if debug else [])]), build=refuse)
    sent = []

    async def receive():
        return {"type": "lifespan.startup"}

    async def send(message):
        sent.append(message)

    with pytest.raises(ValueError, match="no such model"):  # and uvicorn, having logged the message, exits
        asyncio.run(app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
    (failed,) = [message for message in sent if message["type"] == "lifespan.startup.failed"]
    if debug:
        assert "Traceback" in failed["message"] and "no such model" in failed["message"]
    else:
        assert failed["message"] == "no such model (--debug prints the traceback)"


def test_a_cuda_device_without_a_gpu_is_refused_with_what_to_use_instead(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # as on a machine without one
    with pytest.raises(ValueError, match="no CUDA GPU.*use --device cpu"):
        init_training_group(0, 1, "cuda", "127.0.0.1", 0)
