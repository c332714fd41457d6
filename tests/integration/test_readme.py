"""The README's tutorial, pasted as a new user pastes it: the client environment of step 2 is built by its
install block, pasted into bash in a fresh home directory, and every block marked `<!-- readme-test: run -->`
runs verbatim in that environment, each in a fresh process, against the README's server on its first start,
with the API key taken from the banner's `export` line. The server's own install block is the one the test
command ran (it is checked to name the same script).
"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from support.live_server import REPO_ROOT, LiveServer

README = REPO_ROOT / "README.md"
_BLOCK = re.compile(r"<!-- readme(?:-test)?: (\w+) -->\n```(\w+)\n(.*?)\n```", re.DOTALL)
_EXPORT = re.compile(r"^\s+Use it:\s+export (.+)$", re.MULTILINE)
SNIPPET_SECONDS = 300
INSTALL_SECONDS = 1200


def blocks(kind: str) -> list[tuple[str, str]]:
    """(language, code) of the README's blocks marked `kind` (run or install), in order."""
    return [(language, code) for marker, language, code in _BLOCK.findall(README.read_text()) if marker == kind]


def banner_environment(server: LiveServer) -> dict[str, str]:
    """TINKER_BASE_URL and TINKER_API_KEY as the banner's `export` line sets them."""
    line = _EXPORT.search(server.log_path.read_text()).group(1)
    return dict(pair.split("=", 1) for pair in line.split())


@pytest.fixture(scope="module")
def client_bin(tmp_path_factory) -> Path:
    """The bin directory of the client environment that the README's step 2 builds, pasted verbatim into bash in
    the clone, with $HOME a fresh directory (pip keeps its usual configuration and cache of downloads)."""
    home = tmp_path_factory.mktemp("home")
    _, code = blocks("install")[1]
    env = dict(os.environ, HOME=str(home), PIP_CACHE_DIR=pip_cache_dir(),
               XDG_CONFIG_HOME=os.environ.get("XDG_CONFIG_HOME", str(Path.home() / ".config")))
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=INSTALL_SECONDS)
    assert done.returncode == 0, f"README's client install failed:\n{code}\n--- stderr\n{done.stderr[-5000:]}"
    return home / "tinker-client" / "bin"


def pip_cache_dir() -> str:
    done = subprocess.run(["python3", "-m", "pip", "cache", "dir"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else str(Path.home() / ".cache" / "pip")


@pytest.fixture(scope="module")
def user_dir(first_start_server: LiveServer, tmp_path_factory) -> Path:
    """The user's working directory: the server's directory, with its ./data."""
    directory = tmp_path_factory.mktemp("user")
    (directory / "data").symlink_to(first_start_server.data_dir, target_is_directory=True)
    return directory


def run_snippet(language: str, code: str, cwd: Path, environment: dict[str, str], client_bin: Path) -> str:
    """Run a snippet as the README says, in the client environment (its bin first on PATH, as `activate` does)."""
    script = cwd / ("snippet.py" if language == "python" else "snippet.sh")
    script.write_text(code + "\n")
    command = [str(client_bin / "python"), str(script)] if language == "python" else ["bash", "-euo", "pipefail",
                                                                                     str(script)]
    env = {key: value for key, value in os.environ.items() if not key.startswith("TINKER_")}
    env.pop("PYTHONPATH", None)
    env.update(environment, TINKER_TELEMETRY="0", VIRTUAL_ENV=str(client_bin.parent),
               PATH=f"{client_bin}:{os.environ['PATH']}")
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=SNIPPET_SECONDS)
    assert done.returncode == 0, f"README snippet failed:\n{code}\n--- stdout\n{done.stdout[-3000:]}\n" \
                                 f"--- stderr\n{done.stderr[-5000:]}"
    return done.stdout


def losses(output: str) -> list[float]:
    return [float(value) for value in re.findall(r"^step \d+: loss ([\d.]+)$", output, re.MULTILINE)]


def test_the_readme_has_the_tutorials_snippets():
    assert [language for language, _ in blocks("run")] == ["python", "python", "bash"]
    assert len(blocks("install")) == 3


def test_the_text_example_trains_and_prints_decoded_samples(first_start_server, user_dir, client_bin):
    language, code = blocks("run")[0]
    output = run_snippet(language, code, user_dir, banner_environment(first_start_server), client_bin)
    assert len(losses(output)) == 5 and losses(output)[-1] < losses(output)[0], output
    assert len(re.findall(r"^sampled: '.*'$", output, re.MULTILINE)) == 2, output


def test_the_image_example_runs_alone_and_prints_a_decoded_sample(first_start_server, user_dir, client_bin):
    language, code = blocks("run")[1]
    output = run_snippet(language, code, user_dir, banner_environment(first_start_server), client_bin)
    assert len(losses(output)) == 5 and losses(output)[-1] < losses(output)[0], output
    assert re.search(r"^sampled: '.*'$", output, re.MULTILINE), output


def test_the_cookbook_recipe_runs_against_the_tutorials_server(first_start_server, user_dir, client_bin):
    language, code = blocks("run")[2]
    run_snippet(language, code, user_dir, banner_environment(first_start_server), client_bin)
    metrics = [json.loads(line) for line in (user_dir / "runs" / "chat_sl" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == [0, 1, 2, 3]
    assert metrics[-1]["train_mean_nll"] < metrics[0]["train_mean_nll"]


def test_the_server_install_block_is_what_the_test_command_runs_and_ci_runs_the_test_command(first_start_server):
    server, _, test = (code for _, code in blocks("install"))
    assert "python3 -m venv .venv && . .venv/bin/activate" in server and "bash scripts/install.sh" in server
    assert "bash scripts/install.sh" in (REPO_ROOT / "scripts" / "test.sh").read_text()
    served = re.search(r"^python -m server (.*?)(?:\s+#.*)?$", server, re.MULTILINE).group(1).split()
    assert served == ["--base-model", "builtin:tiny-qwen2-vl"]
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert test.strip() == "bash scripts/test.sh" and "python3 -m venv .venv" in ci and "scripts/test.sh" in ci


def test_the_readme_holds_no_placeholder_where_a_measured_number_belongs():
    assert not re.findall(r"\b[A-Z]+_(?:TIME|DISK)\b", README.read_text())


def test_the_server_said_what_it_was_doing_before_it_said_ready(first_start_server):
    log = first_start_server.log_path.read_text()
    order = ["event=starting", "event=model_load_started", "event=model_loaded", "  Address:    http://127.0.0.1:",
             "  Dashboard:  http://127.0.0.1:", "  Use it:     export TINKER_BASE_URL=", "Ready: serving builtin:tiny-qwen2-vl",
             "event=ready"]
    positions = [log.index(line) for line in order]
    assert positions == sorted(positions), log[:4000]
    assert "\r" not in log  # no progress bars in a log file
    # What start-up made (libraries, the model, the services) was moved out of the garbage collector's reach.
    assert int(re.search(r"event=ready .* frozen_objects=(\d+)", log).group(1)) > 10_000
