"""The sampling hot path served by the HTTP protocol itself (server/direct_routes.py), over raw sockets: kept-alive
and pipelined connections that mix it with ASGI requests, and its refusals, answered as the ASGI path answers
them (an HTTP/1.0 request still takes that path)."""

import json
import socket
import time

from support.live_server import BASE_MODEL, LiveServer

SAMPLE = json.dumps({"base_model": BASE_MODEL, "num_samples": 1, "sampling_params": {"max_tokens": 2},
                     "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}}).encode()


def _request(path: str, body: bytes | None, key: str, *, version: str = "1.1", extra: str = "") -> bytes:
    head = f"POST {path} HTTP/{version}\r\nHost: a\r\nX-API-Key: {key}\r\nContent-Type: application/json\r\n{extra}"
    if body is None:
        return f"GET {path} HTTP/{version}\r\nHost: a\r\n{extra}\r\n".encode()
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


def _responses(connection: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """The next `count` responses on the connection: (status, headers, body)."""
    stream = connection.makefile("rb")
    answers = []
    for _ in range(count):
        status = int(stream.readline().split()[1])
        headers = {}
        while (line := stream.readline()) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.lower()] = value.strip()
        answers.append((status, headers, stream.read(int(headers["content-length"]))))
    return answers


def _connect(server: LiveServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=60)


def test_hot_requests_on_one_kept_alive_connection_are_answered_in_order_pipelined_or_not(fault_server):
    key = fault_server.api_key
    with _connect(fault_server) as connection:
        for _ in range(2):  # kept alive: a second sample on the same connection
            connection.sendall(_request("/api/v1/asample", SAMPLE, key))
            [(status, _, body)] = _responses(connection, 1)
            assert status == 200, body
        request_id = json.loads(body)["request_id"]
        poll = json.dumps({"request_id": request_id}).encode()
        unknown = json.dumps({"request_id": "sample-unknown"}).encode()
        # One write: a poll, an ASGI request behind it, and a hot request behind that.
        connection.sendall(_request("/api/v1/retrieve_future", poll, key) + _request("/api/v1/healthz", None, key)
                           + _request("/api/v1/retrieve_future", unknown, key))
        (result, result_headers, _), (health, _, _), (gone, _, gone_body) = _responses(connection, 3)
        assert (result, result_headers["content-type"]) == (200, "application/x-protobuf")
        assert health == 200
        assert gone == 410 and json.loads(gone_body)["category"] == "user", gone_body
        connection.sendall(_request("/api/v1/asample", SAMPLE, key, extra="Connection: close\r\n"))
        [(status, headers, _)] = _responses(connection, 1)
        assert (status, headers["connection"]) == (200, "close")
        assert connection.recv(1) == b""  # and closed


def test_hot_route_refusals_are_the_asgi_paths_and_the_connection_goes_on(fault_server):
    key = fault_server.api_key
    cases = {"a bad key": ("/api/v1/asample", SAMPLE, "tml-not-a-key", 401),
             "a malformed body": ("/api/v1/asample", b'{"base_model": ', key, 400),
             "a body of the wrong shape": ("/api/v1/retrieve_future", b'{"request": 1}', key, 400)}
    before = {path: fault_server.metric("tinker_http_requests_total", route=path, method="POST", status="400")
              for path in ("/api/v1/asample", "/api/v1/retrieve_future")}
    with _connect(fault_server) as connection:
        for case, (path, body, case_key, expected) in cases.items():
            connection.sendall(_request(path, body, case_key))
            [(status, headers, answer)] = _responses(connection, 1)
            with _connect(fault_server) as asgi:  # HTTP/1.0 goes through uvicorn's ASGI path, as every request did
                asgi.sendall(_request(path, body, case_key, version="1.0"))
                [(asgi_status, asgi_headers, asgi_answer)] = _responses(asgi, 1)
            assert (status, answer) == (asgi_status, asgi_answer) == (expected, answer), case
            assert set(json.loads(answer)) == {"detail", "error", "category"}, case
            assert headers["content-type"] == asgi_headers["content-type"] == "application/json", case
        connection.sendall(_request("/api/v1/asample", SAMPLE, key))  # the same connection still serves
        assert _responses(connection, 1)[0][0] == 200
    for path, count in before.items():  # counted as the ASGI path counts them (each case twice)
        expected = count + 2 * sum(case[0] == path and case[3] == 400 for case in cases.values())
        assert fault_server.metric("tinker_http_requests_total", route=path, method="POST", status="400") == expected
    with _connect(fault_server) as connection:  # a declared body over the limit is refused before it comes
        connection.sendall(b"POST /api/v1/asample HTTP/1.1\r\nHost: a\r\nX-API-Key: " + key.encode()
                           + b"\r\nContent-Length: 999999999999\r\n\r\n")
        [(status, _, answer)] = _responses(connection, 1)
        assert status == 413 and b"over the limit" in answer, answer


def test_a_client_that_leaves_mid_body_or_mid_poll_leaves_the_server_serving(fault_server):
    key = fault_server.api_key
    lost = fault_server.metric("tinker_http_requests_total", route="/api/v1/asample", method="POST", status="400")
    with _connect(fault_server) as connection:
        connection.sendall(_request("/api/v1/asample", SAMPLE, key)[:-5])
    deadline = time.monotonic() + 60
    # Counted as the ASGI path counted a body that never came: 400, answered to no one.
    while fault_server.metric("tinker_http_requests_total", route="/api/v1/asample", method="POST",
                              status="400") == lost:
        assert time.monotonic() < deadline
    with _connect(fault_server) as connection:
        connection.sendall(_request("/api/v1/asample", SAMPLE, key))
        [(_, _, body)] = _responses(connection, 1)
        poll = json.dumps({"request_id": json.loads(body)["request_id"]}).encode()
        connection.sendall(_request("/api/v1/retrieve_future", poll, key))
    with _connect(fault_server) as connection:
        connection.sendall(_request("/api/v1/asample", SAMPLE, key))
        assert _responses(connection, 1)[0][0] == 200
