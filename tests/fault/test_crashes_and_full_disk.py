"""kill -9 during checkpoint overwrites and during a training step, a second server on the same journal, full disks,
SIGTERM mid-request."""

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.response_conv import deserialize_forward_backward_output

from support.fault import journal_path, run_journal
from support.live_server import BASE_MODEL, REPO_ROOT, LiveServer, free_port, start_server
from support.raw_run import RawRun
from support.sdk import SENTENCES, forward_logprobs, supervised_datum

KILLS = 3


def _pending_futures(server: LiveServer) -> int:
    with sqlite3.connect(f"file:{journal_path(server)}?mode=ro", uri=True) as journal:
        return journal.execute("SELECT count(*) FROM futures WHERE status = 'pending'").fetchone()[0]


@dataclass
class Save:
    """One save the writer sent: its checkpoint, the logprobs of the weights it saves, whether it completed."""

    path: str
    logprobs: list[float]
    completed: bool = False


def _overwrite_until_killed(server: LiveServer, saves: list[Save]) -> None:
    """Train and overwrite one sampler checkpoint and one training checkpoint back to back, noting each save
    with the logprobs of the weights it saves (raw HTTP, so the thread ends as soon as the server is gone)."""
    try:
        with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as http:
            run = RawRun(http)
            while True:
                response = run.forward(run.forward_body(run.next_seq_id()))
                assert response.status_code == 200, response.text
                output = deserialize_forward_backward_output(run.result(response.json()["request_id"]))
                logprobs = output.loss_fn_outputs[0]["logprobs"].tolist()
                for path, name, segment in (("/api/v1/save_weights_for_sampler", "keep", "sampler_weights"),
                                            ("/api/v1/save_weights", "keep-state", "weights")):
                    save = Save(f"tinker://{run.model_id}/{segment}/{name}", logprobs)
                    saves.append(save)
                    assert _outcome(run, path, {"path": name, "overwrite": True}) == "complete"
                    save.completed = True
                # A large step, so that the logprobs of consecutive saves tell them apart.
                assert _outcome(run, "/api/v1/optim_step", {"adam_params": {"learning_rate": 1e-2}}) == "complete"
    except (httpx.HTTPError, AssertionError):  # the server was killed under it
        pass


def _unlisted_versions(server: LiveServer) -> set[Path]:
    """Version directories no checkpoint row points at: a save being written, or an old version not yet
    deleted after its overwrite."""
    listed = _listed_directories(server)
    return {version for version in (server.data_dir / "checkpoints").glob("*/*/*/v-*") if str(version) not in listed}


def _kill_inside_a_write(server: LiveServer) -> set[Path]:
    """SIGKILL the server while a checkpoint is half-way through an overwrite; returns the versions it leaves.
    The server is stopped (SIGSTOP) to look, so what is seen is what the kill leaves."""
    deadline = time.monotonic() + 120  # a hang guard; overwrites follow each other back to back
    while time.monotonic() < deadline:
        if _unlisted_versions(server):
            server.process.send_signal(signal.SIGSTOP)
            if leftovers := _unlisted_versions(server):
                server.process.send_signal(signal.SIGKILL)
                server.process.wait()
                return leftovers
            server.process.send_signal(signal.SIGCONT)
    raise AssertionError("no overwrite was ever seen half-way")


def test_kill_9_during_checkpoint_overwrites_never_loses_or_halves_a_checkpoint(models_dir, tmp_path):
    data_dir = tmp_path / "data"
    saves: list[Save] = []
    server = start_server(data_dir, None, models_dir)
    for kill in range(KILLS):
        completed_before = sum(save.completed for save in saves)
        writer = threading.Thread(target=_overwrite_until_killed, args=(server, saves), daemon=True)
        writer.start()
        deadline = time.monotonic() + 120  # a hang guard
        # Each kind saved twice: the kill lands in an overwrite of weights that training has moved.
        while sum(save.completed for save in saves) < completed_before + 4:
            assert time.monotonic() < deadline and writer.is_alive(), "no save completed in this round"
            time.sleep(0.05)
        leftovers = _kill_inside_a_write(server)
        writer.join(timeout=60)
        server = start_server(data_dir, None, models_dir)
        assert f"event=checkpoint_leftovers_removed count={len(leftovers)} " in server.log_path.read_text()
        _check_every_completed_checkpoint_loads_as_saved(server, saves, data_dir)
    server.stop()
    print(f"kill -9 during overwrites: {KILLS} kills inside a write, {sum(s.completed for s in saves)} completed "
          "saves, 0 lost, 0 half-written, each loads with the logprobs it was saved with")


def _check_every_completed_checkpoint_loads_as_saved(server: LiveServer, saves: list[Save], data_dir: Path) -> None:
    rest = tinker.RestClient(base_url=server.url, api_key=server.api_key)
    listed = {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    completed = {save.path for save in saves if save.completed}
    assert completed <= listed, f"completed checkpoints missing after the restart: {completed - listed}"
    service = server.service_client()
    tokens = [5, 6, 7, 8]  # RawRun's datum: targets equal to the inputs
    for path in sorted(listed):
        # Listed: the last save that completed, or one sent after it that the kill cut off from its answer.
        sent = [save for save in saves if save.path == path]
        last = max(index for index, save in enumerate(sent) if save.completed)
        if "/sampler_weights/" in path:
            sampler = service.create_sampling_client(model_path=path).result()
            # The last position's logprob: token 8 after 5, 6, 7, 8, as the trainer scored it.
            loaded = sampler.compute_logprobs(types.ModelInput.from_ints(tokens + [8])).result()[-1:]
            expected = [save.logprobs[-1:] for save in sent[last:]]
        else:
            training = service.create_training_client_from_state_with_optimizer(path).result()
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                                loss_fn_inputs={"target_tokens": tokens, "weights": [1.0] * len(tokens)})
            loaded = forward_logprobs(training, [datum])[0]
            expected = [save.logprobs for save in sent[last:]]
        assert any(np.allclose(loaded, logprobs, rtol=0, atol=1e-4) for logprobs in expected), (path, loaded, expected)
        # ... and not the run's first save (the untrained adapter): the check tells versions apart.
        assert not np.allclose(loaded, sent[0].logprobs[-len(loaded):], rtol=0, atol=1e-3), (path, loaded)
    versions = {str(p) for p in (data_dir / "checkpoints").glob("*/*/*/v-*")}
    assert versions == _listed_directories(server), "unlisted checkpoint files survived the restart"


def _listed_directories(server: LiveServer) -> set[str]:
    with sqlite3.connect(f"file:{journal_path(server)}?mode=ro", uri=True) as journal:
        return {row[0] for row in journal.execute("SELECT directory FROM checkpoints")}


def test_a_second_server_on_the_same_journal_by_another_path_refuses_to_start_and_fails_nothing_of_the_first(
        fault_server, tmp_path):
    """The same data directory is refused as plainly (tests/unit/store); here the harder case: another data
    directory, and --database-url naming the first one's journal through a symbolic link."""
    journal = journal_path(fault_server)
    with sqlite3.connect(journal) as connection:  # a request the first server holds in its journal, pending
        connection.execute("INSERT INTO futures (request_id, request_type, owner, payload_hash, status, created_at) "
                           "VALUES ('held-by-the-first', 'ForwardBackward', 'default', '', 'pending', "
                           "'2026-01-01 00:00:00')")
    (tmp_path / "link").symlink_to(fault_server.data_dir, target_is_directory=True)
    try:
        # A port of its own: the port is taken before the data directory is looked at.
        second = subprocess.run([sys.executable, "-m", "server", "--base-model", BASE_MODEL, "--port",
                                 str(free_port()), "--data-dir", str(tmp_path / "second"), "--database-url",
                                 f"sqlite:///{tmp_path}/link/server.db"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=300, env=dict(os.environ, TINKER_TELEMETRY="0"))
        assert second.returncode == 3, second.stdout + second.stderr  # a start-up refused for what was given
        assert f"another server (pid {fault_server.process.pid}) already uses the database" in second.stderr
        with sqlite3.connect(journal) as connection:
            assert connection.execute("SELECT status FROM futures WHERE request_id = 'held-by-the-first'"
                                      ).fetchone() == ("pending",)
    finally:
        with sqlite3.connect(journal) as connection:
            connection.execute("DELETE FROM futures WHERE request_id = 'held-by-the-first'")
    with httpx.Client(base_url=fault_server.url, headers=fault_server.headers(), timeout=120) as http:
        run = RawRun(http)  # the first server goes on
        assert isinstance(run.result(run.forward(run.forward_body(run.next_seq_id())).json()["request_id"]), bytes)


@pytest.fixture
def small_disks(tmp_path) -> Iterator[tuple[Path, Path]]:
    """Two 32 MiB tmpfs mounts: one for the journal database, one for the data directory (checkpoints)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mounts = (tmp_path / "journal-disk", tmp_path / "data-disk")
    for mount in mounts:
        mount.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)], check=True)
    yield mounts
    for mount in mounts:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(directory: Path, leave_bytes: int = 0) -> Path:
    """Fill the file system of `directory`, then give `leave_bytes` back."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\x00" * (1 << 20))
        except OSError:
            pass
        try:
            while True:
                handle.write(b"\x00" * 4096)
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - leave_bytes))
    return filler


def test_a_full_disk_fails_requests_clearly_ends_every_future_and_recovers_when_space_is_freed(models_dir,
                                                                                               small_disks):
    journal_disk, data_disk = small_disks
    server = start_server(data_disk / "data", f"sqlite:///{journal_disk}/server.db", models_dir)
    answers: dict[str, str] = {}
    try:
        with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as http:
            run = RawRun(http)
            assert _outcome(run, "/api/v1/save_weights", {"path": "before-full"}) == "complete"
            # The checkpoint disk fills: saves fail and leave nothing behind, the rest of the run goes on.
            filler = _fill(data_disk)
            answers["checkpoints full: save_weights"] = _outcome(run, "/api/v1/save_weights", {"path": "x"})
            answers["checkpoints full: save_weights_for_sampler"] = _outcome(
                run, "/api/v1/save_weights_for_sampler", {"path": "x"})
            answers["checkpoints full: forward_backward"] = _outcome(run, "/api/v1/forward_backward")
            assert answers["checkpoints full: save_weights"].startswith("failed: the server's disk is full"), answers
            assert answers["checkpoints full: forward_backward"] == "complete", answers
            assert http.get("/api/v1/healthz").json() == {"status": "degraded",
                                                          "detail": "the disk of the checkpoints is full"}
            filler.unlink()
            # The journal's disk fills.
            filler = _fill(journal_disk)
            # Whatever is sent while the disk is full ends, with its result or a clear error.
            answers["create_session"] = _status(http.post("/api/v1/create_session", json={}))
            answers["forward_backward"] = _outcome(run, "/api/v1/forward_backward")
            answers["save_weights"] = _outcome(run, "/api/v1/save_weights", {"path": "during-full"})
            answers["save_weights_for_sampler"] = _outcome(run, "/api/v1/save_weights_for_sampler",
                                                           {"path": "during-full"})
            answers["optim_step"] = _outcome(run, "/api/v1/optim_step", {"adam_params": {"learning_rate": 1e-3}})
            sample = http.post("/api/v1/asample", json={"base_model": BASE_MODEL, "sampling_params": {"max_tokens": 2},
                                                        "prompt": {"chunks": [{"type": "encoded_text",
                                                                               "tokens": [5, 6]}]}})
            answers["asample"] = _status(sample) if sample.status_code != 200 else _state(
                run.result(sample.json()["request_id"]))
            # Every submission the journal must take is refused with a 507 (the SDK retries it); sampling, kept in
            # memory, goes on.
            for name in ("create_session", "forward_backward", "save_weights", "save_weights_for_sampler",
                         "optim_step"):
                assert answers[name].startswith("507: the server's disk is full"), (name, answers[name])
            assert answers["asample"] == "complete", answers
            for name, answer in answers.items():
                assert str(data_disk) not in answer and str(journal_disk) not in answer, (name, answer)
            assert http.get("/api/v1/healthz").json()["status"] == "degraded"
            filler.unlink()  # the operator frees space
            # The run goes on; nothing half-saved is listed and everything listed loads.
            assert _outcome(run, "/api/v1/forward_backward") == "complete"
            assert _outcome(run, "/api/v1/save_weights", {"path": "after-full"}) == "complete"
            listed = {c["tinker_path"] for c in http.get(f"/api/v1/training_runs/{run.model_id}/checkpoints")
                      .json()["checkpoints"]}
            assert {f"tinker://{run.model_id}/weights/before-full", f"tinker://{run.model_id}/weights/after-full"} \
                <= listed
            service = server.service_client()
            for path in listed:
                if "/sampler_weights/" in path:
                    service.create_sampling_client(model_path=path).result()
                else:
                    service.create_training_client_from_state(path).result()
            metrics = http.get("/metrics").text
            assert 'status="500"' not in metrics, [line for line in metrics.splitlines() if 'status="500"' in line]
            deadline = time.monotonic() + 30  # outcomes kept in memory reach the journal on the next round
            while _pending_futures(server) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert _pending_futures(server) == 0
            assert http.get("/api/v1/healthz").json() == {"status": "ok"}
        print(f"full disk: {answers}")
    finally:
        server.stop()


def test_one_full_disk_holding_both_journal_and_checkpoints_fails_clearly_and_recovers(models_dir, small_disks):
    disk = small_disks[0]
    server = start_server(disk / "data", None, models_dir)  # the journal in the data directory, as by default
    try:
        with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as http:
            run = RawRun(http)
            filler = _fill(disk)
            both = "the disk of the checkpoints and the journal is full"
            assert http.get("/api/v1/healthz").json() == {"status": "degraded", "detail": both}
            answers = {"save_weights": _outcome(run, "/api/v1/save_weights", {"path": "full"}),
                       "forward_backward": _outcome(run, "/api/v1/forward_backward"),
                       "create_session": _status(http.post("/api/v1/create_session", json={}))}
            assert answers["save_weights"].startswith(("failed: the server's disk is full", "507")), answers
            for name, answer in answers.items():
                assert answer in ("complete", "200") or "disk is full" in answer, (name, answer)
            filler.unlink()
            assert _outcome(run, "/api/v1/save_weights", {"path": "after"}) == "complete"
            assert http.get("/api/v1/healthz").json() == {"status": "ok"}
            assert 'status="500"' not in http.get("/metrics").text
    finally:
        server.stop()


def _status(response: httpx.Response) -> str:
    return str(response.status_code) if response.status_code == 200 else \
        f"{response.status_code}: {response.json()['detail']}"


def _state(result: dict | bytes) -> str:
    return "complete" if isinstance(result, bytes) or "error" not in result else f"failed: {result['error']}"


def _outcome(run: RawRun, path: str, fields: dict | None = None) -> str:
    """Send one request of the run (its next seq_id) and wait for its outcome: complete, failed: ..., or the
    HTTP refusal of a submission the journal could not take (then the same seq_id is sent again later)."""
    seq_id = run.next_seq_id()
    if path == "/api/v1/forward_backward":
        response = run.forward(run.forward_body(seq_id))
    else:
        response = run.http.post(path, json={"model_id": run.model_id, "seq_id": seq_id, **(fields or {})})
    if response.status_code != 200:
        run.seq_id -= 1  # not journaled: the slot is still free
        return _status(response)
    return _state(run.result(response.json()["request_id"]))


def test_sigterm_stops_within_the_shutdown_timeout_and_fails_what_was_running(models_dir, tmp_path):
    server = start_server(tmp_path / "data", None, models_dir, "--shutdown-timeout", "2")
    sampler = server.service_client().create_sampling_client(base_model=BASE_MODEL).result()
    long_sample = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 8,
                                 types.SamplingParams(max_tokens=8192, stop=[]))
    deadline = time.monotonic() + 120  # hang guards, not margins
    while httpx.get(f"{server.url}/api/v1/dashboard/overview", headers=server.headers()).json()["sampling"][
            "in_flight"] < 1:
        assert time.monotonic() < deadline, "the sample never reached the engine"
        time.sleep(0.05)
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(timeout=120)
    # Cut at the timeout, not awaited: 8 x 8192 tokens take minutes here, and a shutdown that waited for
    # them would count the sample as finished.
    log = server.log_path.read_text()
    assert "event=shutdown " in log and "finished_running=0 " in log and "failed_running=1" in log, log[-2000:]
    del long_sample


def _kill_mid_step(server: LiveServer, model_id: str) -> None:
    """SIGKILL the server while the run's forward_backward runs with its optim_step queued behind it, both
    journaled (the server is stopped to look, so what is seen is what the kill leaves)."""
    step = [("ForwardBackward", "pending"), ("OptimStep", "pending")]
    too_late = "the forward_backward finished before the kill: give it a larger batch"
    deadline = time.monotonic() + 120  # a hang guard
    while (last := [row[:2] for row in run_journal(server, model_id)[-2:]]) != step:
        assert ("ForwardBackward", "complete") not in last, too_late
        assert time.monotonic() < deadline, last
        time.sleep(0.01)
    server.process.send_signal(signal.SIGSTOP)
    assert [row[:2] for row in run_journal(server, model_id)[-2:]] == step, too_late
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()


def _send_step(training: tinker.TrainingClient, batch: list[types.Datum]) -> list:
    """One training step, sent as a training loop sends it: forward_backward and optim_step back to back."""
    return [training.forward_backward(batch, "cross_entropy"),
            training.optim_step(types.AdamParams(learning_rate=1e-2))]


def _train_step(training: tinker.TrainingClient, batch: list[types.Datum]) -> None:
    for future in _send_step(training, batch):
        future.result()


def test_a_kill_9_mid_training_step_asks_for_it_again_and_a_resumed_run_ends_where_one_never_killed_ends(
        models_dir, tmp_path):
    """Training futures are journaled: the requests of a step the kill cut short answer "send it again" after the
    restart (never a result for a step whose effect was lost), and a client that resumes from its checkpoint and
    sends the step again ends with the weights and optimizer state of a run never killed: the step applied once.
    Sampling futures live in memory: a sample in flight is sent again by the SDK, whose poll gets a 410, and its
    caller only sees the result come later."""
    data_dir, port = tmp_path / "data", free_port()
    server = start_server(data_dir, None, models_dir, port=port)
    service = server.service_client()
    never_killed = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    probe = [supervised_datum(never_killed.get_tokenizer(), SENTENCES[0])]
    small = probe * 2
    # Long enough (0.3 s or so here) that its optim_step is journaled behind its forward_backward before it ends.
    tokens = list(range(5, 5 + 257))
    large = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                         loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 256})] * 12
    _train_step(never_killed, small)
    _train_step(never_killed, large)
    expected = forward_logprobs(never_killed, probe)[0]

    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    _train_step(training, small)
    saved = training.save_state("step-1").result().path
    sampler = service.create_sampling_client(base_model=BASE_MODEL).result()
    # Long enough to be in flight at the kill (sent 0.2 s before it, on a loaded box): the 410 below shows it was.
    sample = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2, types.SamplingParams(max_tokens=1000, stop=[]))
    deadline = time.monotonic() + 60
    while server.metric("tinker_http_requests_total", route="/api/v1/asample", method="POST", status="200") < 1:
        assert time.monotonic() < deadline, "the sample was never accepted"
        time.sleep(0.05)
    cut_short = _send_step(training, large)
    _kill_mid_step(server, training.model_id)
    restarted = start_server(data_dir, None, models_dir, port=port)
    restarted.api_key = server.api_key  # the first start's key, an admin's: it reads the metrics
    try:
        for future in cut_short:
            with pytest.raises(tinker.RequestFailedError, match="the server restarted before this request finished; "
                                                                 "send it again"):
                future.result(timeout=300)
        # The run's weights were in memory: the client is told to resume from a checkpoint ...
        with pytest.raises(tinker.RequestFailedError, match="not loaded on this server"):
            training.forward(probe, "cross_entropy").result()
        # ... and doing so, sending the step again, it ends where the run never killed ends.
        resumed = restarted.service_client().create_training_client_from_state_with_optimizer(saved).result()
        _train_step(resumed, large)
        np.testing.assert_allclose(forward_logprobs(resumed, probe)[0], expected, rtol=0, atol=1e-5)

        response = sample.result(timeout=300)
        assert [len(sequence.tokens) for sequence in response.sequences] == [1000, 1000]
        assert restarted.metric("tinker_http_requests_total", route="/api/v1/retrieve_future", method="POST",
                                status="410") >= 1
    finally:
        restarted.stop()
