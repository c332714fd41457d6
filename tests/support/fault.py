"""The fault tier's shared settings and helpers (tests/fault's conftest and tests, and the data-parallel tests,
import them here)."""

import os
import signal
import sqlite3
import time
from pathlib import Path

import tinker
from tinker import types

from support.live_server import LiveServer

GAP_SECONDS = 2
"""The fault server's --seq-gap-timeout: short, so that the gaps a campaign leaves close quickly."""


def journal_path(server: LiveServer) -> Path:
    if server.database_url:
        return Path(server.database_url.removeprefix("sqlite:///"))
    return server.data_dir / "server.db"


def run_journal(server: LiveServer, model_id: str) -> list[tuple[str, str, str | None]]:
    """A run's journaled requests in seq_id order: (request type, status, error)."""
    with sqlite3.connect(f"file:{journal_path(server)}?mode=ro", uri=True) as journal:
        return journal.execute("SELECT request_type, status, error FROM futures WHERE model_id = ? ORDER BY seq_id",
                               (model_id,)).fetchall()


def kill_rank_mid_step(server: LiveServer, pid: int, training: tinker.TrainingClient,
                       batch: list[types.Datum]) -> list:
    """SIGKILL a training rank (process `pid`) while a step runs: it is stopped (SIGSTOP) first, so the step's
    forward_backward waits for it in a collective; the kill comes once its optim_step is journaled behind it.
    Returns the step's futures."""
    os.kill(pid, signal.SIGSTOP)
    step = [training.forward_backward(batch, "cross_entropy"), training.optim_step(types.AdamParams(learning_rate=1e-2))]
    deadline = time.monotonic() + 120  # a hang guard
    while [row[:2] for row in run_journal(server, training.model_id)[-2:]] != [("ForwardBackward", "pending"),
                                                                               ("OptimStep", "pending")]:
        assert time.monotonic() < deadline, run_journal(server, training.model_id)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    return step


def check_stopped_for_lost_rank(server: LiveServer, rank: int, model_id: str) -> None:
    """The server stopped on its own with a failure status and what to do, and failed the run's step (the
    forward_backward as it ran, the optim_step before it ran) with the cause: nothing pending in the journal."""
    assert server.process.wait(timeout=120) == 1, (server.process.returncode, server.log())
    log = server.log_path.read_text()
    assert f"event=training_rank_lost rank={rank} " in log and "Start it again with the same command" in log, log[-3000:]
    cause = f"training rank {rank} died (killed, out of memory, or its node went down)"
    *_, forward_backward, optim_step = run_journal(server, model_id)
    assert forward_backward[:2] == ("ForwardBackward", "failed") and optim_step[:2] == ("OptimStep", "failed")
    # Over gloo the forward_backward's collective fails at once; over NCCL it waits until the shutdown gives up
    # on it (--shutdown-timeout): either way its message opens with the cause.
    assert forward_backward[2].startswith(cause) and "while this request ran" in forward_backward[2], forward_backward
    assert optim_step[2].startswith(f"{cause}: the server shut down before this request ran"), optim_step
    assert all(status != "pending" for _, status, _ in run_journal(server, model_id))
