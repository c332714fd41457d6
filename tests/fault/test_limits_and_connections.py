"""What a key holder, or anyone who reaches the port, cannot do: fill the journal through free-form fields or
many sessions (each refusal a 400 that names its limit; sessions can be deleted), or hold connections open
with headers or a body that never finish, or with more connections than its address may keep."""

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.wire import tinker_public_pb2 as pb
from server.wire.base import MAX_METADATA_BYTES
from support.live_server import LiveServer, start_server
from support.raw_run import RawRun

TIMEOUT_SECONDS = 2
CONNECTIONS_PER_CLIENT = 8
QUOTA_GB = 0.001  # about 1 MiB: some 60 sessions of the largest metadata


@pytest.fixture(scope="module")
def guarded(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory.mktemp("guarded"), None, models_dir, "--header-timeout",
                        str(TIMEOUT_SECONDS), "--body-timeout", str(TIMEOUT_SECONDS), "--max-connections-per-client",
                        str(CONNECTIONS_PER_CLIENT), "--max-stored-gb-per-tenant", str(QUOTA_GB))
    yield live
    live.stop()


def test_free_form_fields_are_bounded_with_a_400_that_names_the_limit(guarded):
    with httpx.Client(base_url=guarded.url, headers=guarded.headers(), timeout=120) as http:
        refused = {
            "a 20 MiB display_name": http.post("/api/v1/create_session", json={"display_name": "x" * (20 << 20)}),
            "100,000 user_metadata keys": http.post("/api/v1/create_session", json={
                "user_metadata": {str(i): "v" for i in range(100_000)}}),
            "65 tags": http.post("/api/v1/create_session", json={"tags": ["t"] * 65}),
            "a search by 5,000 characters": http.post("/api/v1/sessions/search", json={"display_name": "w" * 5000}),
        }
        run = RawRun(http)
        refused["a run's 20 KiB user_metadata"] = http.post("/api/v1/create_model", json={
            "session_id": run.session_id, "model_seq_id": 1, "base_model": "builtin:tiny-qwen3",
            "user_metadata": {"k": "v" * 20_000}})
        refused["a 300-character checkpoint name"] = http.post("/api/v1/save_weights", json={
            "model_id": run.model_id, "seq_id": run.next_seq_id(), "path": "n" * 300})
        many_datums = pb.ForwardBackwardRequest.FromString(run.forward_body(run.next_seq_id()))
        many_datums.data.extend([many_datums.data[0]] * 4096)
        refused["4,097 datums"] = run.forward(many_datums.SerializeToString())
        expected = {"a 20 MiB display_name": "display_name", "100,000 user_metadata keys": "over the limit of 64",
                    "65 tags": "tags", "a search by 5,000 characters": "display_name",
                    "a run's 20 KiB user_metadata": f"over the limit of {MAX_METADATA_BYTES}",
                    "a 300-character checkpoint name": "over the limit of 255",
                    "4,097 datums": "--max-datums-per-request"}
        for what, response in refused.items():
            assert response.status_code == 400 and expected[what] in response.json()["detail"], (what, response.text)
        # Refused with their seq_ids taken: the run goes on.
        assert isinstance(run.result(run.forward(run.forward_body(run.next_seq_id())).json()["request_id"]), bytes)
        assert len(http.post("/api/v1/sessions/search", json={}).content) < 10_000


def test_a_finished_session_is_deleted_with_its_runs_once_it_has_no_checkpoints(guarded):
    with httpx.Client(base_url=guarded.url, headers=guarded.headers(), timeout=120) as http:
        run = RawRun(http)
        session = f"/api/v1/sessions/{run.session_id}"
        saved = http.post("/api/v1/save_weights", json={"model_id": run.model_id, "seq_id": run.next_seq_id(),
                                                        "path": "kept"})
        assert "error" not in run.result(saved.json()["request_id"])
        open_session = http.delete(session)
        assert open_session.status_code == 409 and "finish it first" in open_session.json()["detail"]
        assert http.post(f"{session}/finish", json={"reason": {"type": "success"}}).status_code == 200
        deadline = time.monotonic() + 60
        while (answer := http.delete(session)).status_code == 409 and "requests" in answer.text:
            assert time.monotonic() < deadline, "the finished session's run never left memory"
        assert answer.status_code == 409 and "still has checkpoints" in answer.json()["detail"], answer.text
        checkpoint = f"/api/v1/training_runs/{run.model_id}/checkpoints/weights/kept"
        assert http.delete(checkpoint).status_code == 200
        assert http.delete(session).status_code == 200
        assert http.get(session).status_code == 404
        assert http.get(f"/api/v1/training_runs/{run.model_id}").status_code == 404
        assert http.delete(session).status_code == 404


def test_a_tenants_journal_counts_in_its_storage_quota_and_deleting_sessions_frees_it(guarded):
    metadata = {"k": "v" * (MAX_METADATA_BYTES - 100)}
    with httpx.Client(base_url=guarded.url, headers=guarded.headers(), timeout=120) as http:
        created = []
        while (answer := http.post("/api/v1/create_session", json={"user_metadata": metadata})).status_code == 200:
            created.append(answer.json()["session_id"])
            assert len(created) < 200, "the quota never refused a session"
        assert answer.status_code == 400, answer.text
        assert "of journal" in answer.json()["detail"] and "--max-stored-gb-per-tenant" in answer.json()["detail"]
        for session_id in created[:3]:
            assert http.post(f"/api/v1/sessions/{session_id}/finish", json={"reason": {"type": "success"}}
                             ).status_code == 200
            assert http.delete(f"/api/v1/sessions/{session_id}").status_code == 200
        assert http.post("/api/v1/create_session", json={"user_metadata": metadata}).status_code == 200


def _address(server: LiveServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _answer_or_close(sock: socket.socket) -> bytes:
    """What the server sends before it closes the connection (b"" if it sent nothing)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_headers_dribbled_byte_by_byte_and_a_half_sent_body_are_cut_off_and_the_server_goes_on(guarded):
    headers = b"POST /api/v1/create_session HTTP/1.1\r\nHost: a\r\nX-API-Key: " + guarded.api_key.encode() + \
        b"\r\nX-Padding: " + b"p" * 4000
    with socket.create_connection(_address(guarded), timeout=0.25) as sock:
        for sent, byte in enumerate(headers):
            try:
                sock.sendall(bytes([byte]))
                answer = sock.recv(65536)  # the server's answer, b"" once it closed, or a timeout: go on
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                answer = b""
            break
        else:
            pytest.fail("headers dribbled for 1,000 s were never cut off")
    assert sent < len(headers) and (answer == b"" or answer.startswith(b"HTTP/1.1 408")), answer
    body = b'{"display_name": "slow"}'
    with socket.create_connection(_address(guarded), timeout=60) as sock:
        sock.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
                     b"X-API-Key: " + guarded.api_key.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body[:5])
        assert _answer_or_close(sock) == b""  # closed mid-request: no answer
    with httpx.Client(base_url=guarded.url, headers=guarded.headers()) as http:
        assert http.post("/api/v1/create_session", json={}).status_code in (200, 400)  # 400: the quota test ran
        assert 'status="500"' not in http.get("/metrics").text


def test_one_address_keeps_at_most_its_share_of_connections_open(guarded):
    held = [socket.create_connection(_address(guarded), timeout=120) for _ in range(CONNECTIONS_PER_CLIENT)]
    try:
        with socket.create_connection(_address(guarded), timeout=120) as one_more:
            answer = _answer_or_close(one_more)
        assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections-per-client" in answer, answer
    finally:
        for sock in held:
            sock.close()
    # Closed, they leave room again (the server may see the last ones close just after the next one opens).
    deadline = time.monotonic() + 60
    while (status := httpx.get(f"{guarded.url}/api/v1/healthz").status_code) == 503:
        assert time.monotonic() < deadline
    assert status == 200
