"""Malformed protobuf, zstd, images and JSON, over and over: every answer a 4xx, no run wedged by a body
whose seq_id cannot be read, no memory kept, no future left pending."""

import base64
import io
import sqlite3
import struct
import time
import zlib

import httpx
import zstandard
from PIL import Image

from benchmarks.process_memory import process_tree, rss_mib
from server.wire import tinker_public_pb2 as pb
from support.fault import GAP_SECONDS
from support.live_server import BASE_MODEL, LiveServer
from support.raw_run import RawRun

ROUNDS = 3


def _zstd_bomb(megabytes: int = 1100) -> bytes:
    """A small zstd stream (no declared size) that inflates past the server's 1 GiB limit."""
    compressor = zstandard.ZstdCompressor().compressobj()
    zeros = b"\x00" * (1 << 20)
    return b"".join(compressor.compress(zeros) for _ in range(megabytes)) + compressor.flush()


ZSTD_BOMB = _zstd_bomb()


def _png(width: int = 16, height: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims a huge size (a decompression bomb's header) and has no pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def _image_chunk(data: bytes, image_format: str = "png") -> pb.Chunk:
    chunk = pb.Chunk()
    chunk.image.data, chunk.image.format, chunk.image.expected_tokens = data, image_format, 4
    return chunk


def malformed_training_bodies(run: RawRun, seq_id: int) -> list[tuple[str, bytes, str | None]]:
    valid = run.forward_body(seq_id)
    return [
        ("an image format other than png/jpeg", run.forward_body(seq_id, [_image_chunk(_png(), "gif")]), None),
        ("a corrupt png", run.forward_body(seq_id, [_image_chunk(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)]), None),
        ("a png claiming 100k x 100k pixels", run.forward_body(seq_id, [_image_chunk(_png_header_only(10**5, 10**5))]),
         None),
        ("an empty chunk", run.forward_body(seq_id, [pb.Chunk()]), None),
        ("zstd that is not zstd", valid, "zstd"),
        ("a zstd bomb", ZSTD_BOMB, "zstd"),
        ("a gzip body", valid, "gzip"),
    ]


def malformed_json_requests(run: RawRun) -> list[tuple[str, str, dict]]:
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    return [
        ("/api/v1/optim_step", "seq_id past 64 bits", dict(json={"model_id": run.model_id, "seq_id": 2**70,
                                                                  "adam_params": {}})),
        ("/api/v1/create_model", "rank 2**31", dict(json={"session_id": "s", "model_seq_id": 0,
                                                         "base_model": BASE_MODEL, "lora_config": {"rank": 2**31}})),
        ("/api/v1/asample", "an image_asset_pointer holding NUL", dict(json={
            "base_model": BASE_MODEL, "sampling_params": {"max_tokens": 1}, "prompt": {"chunks": [
                {"type": "image_asset_pointer", "format": "png", "location": "/tmp/a\x00b"}]}})),
        ("/api/v1/asample", "a base64 image that is not one", dict(json={
            "base_model": BASE_MODEL, "sampling_params": {"max_tokens": 1}, "prompt": {"chunks": [
                {"type": "image", "format": "png", "data": base64.b64encode(b"GIF89a" + b"\x00" * 32).decode()}]}})),
        ("/api/v1/asample", "seed 2**70", dict(json={"base_model": BASE_MODEL, "prompt": prompt,
                                                     "sampling_params": {"max_tokens": 1, "seed": 2**70}})),
        ("/api/v1/create_session", "JSON nested 100,000 deep", dict(content=b"[" * 100_000 + b"]" * 100_000,
                                                                    headers={"Content-Type": "application/json"})),
        ("/api/v1/create_session", "not JSON", dict(content=b"\xff\xfe{",
                                                    headers={"Content-Type": "application/json"})),
        *[(route, "JSON nested 2,000 deep", dict(content=_deep_json_slot(),
                                                 headers={"Content-Type": "application/json"}))
          for route in SEQUENCED_JSON_ROUTES],
    ]


SEQUENCED_JSON_ROUTES = ("/api/v1/optim_step", "/api/v1/save_weights", "/api/v1/save_weights_for_sampler",
                         "/api/v1/load_weights", "/api/v1/save_weights_external")


def _deep_json_slot() -> bytes:
    """A readable model_id and seq_id beside a value nested past every JSON parser's depth limit."""
    return b'{"model_id": "another-run", "seq_id": 1, "path": ' + b"[" * 2000 + b"]" * 2000 + b"}"


def test_malformed_inputs_get_4xx_keep_no_memory_and_wedge_no_run(fault_server: LiveServer):
    rss_after_round = []
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=fault_server.url, headers=fault_server.headers(), timeout=120) as http:
        run = RawRun(http)
        for _ in range(ROUNDS):
            for what, content, encoding in malformed_training_bodies(run, run.next_seq_id()):
                if encoding == "zstd" and what.startswith("zstd that"):
                    content = b"\x28\xb5\x2f\xfd" + content[:64]
                answer = run.forward(content, encoding)
                statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
                assert 400 <= answer.status_code < 500, (what, answer.text)
                if what == "a zstd bomb":
                    assert answer.status_code == 413 and "inflates past" in answer.text, answer.text
                # The refusal took its seq_id where it could be read: the next request runs at once.
                good = run.forward(run.forward_body(run.next_seq_id()))
                if isinstance(run.result(good.json()["request_id"]), dict):  # a gap: failed after the timeout
                    assert what in ("zstd that is not zstd", "a zstd bomb", "a gzip body"), what
            for path, what, kwargs in malformed_json_requests(run):
                answer = http.post(path, **kwargs)
                statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
                assert 400 <= answer.status_code < 500, (what, answer.text)
            rss_after_round.append(rss_mib(process_tree(fault_server.process.pid)))
        # The run still trains.
        assert isinstance(run.result(run.forward(run.forward_body(run.next_seq_id())).json()["request_id"]), bytes)
    print(f"malformed inputs: answers {statuses}, server RSS after each round (MiB): {rss_after_round}")
    # Round 1 fills the caches and the allocator's pools; later rounds must not grow (measured: +3 MiB over
    # rounds 2 and 3). What the 60 MiB bound catches: a refused body kept whole or in part (the bomb inflates
    # to 1 GiB before it is refused), i.e. over 2 MiB kept per request (14 a round). What it cannot: a leak of
    # KiBs per request, which only thousands of requests show (benchmarks/server_memory.py measures that).
    assert rss_after_round[-1] - rss_after_round[0] < 60, rss_after_round
    assert _pending_futures(fault_server) == 0


def test_a_seq_id_that_never_arrives_fails_only_the_requests_behind_it_and_the_run_goes_on(fault_server: LiveServer):
    with httpx.Client(base_url=fault_server.url, headers=fault_server.headers(), timeout=120) as http:
        run = RawRun(http)
        valid = run.forward_body(1)
        unreadable = {"random bytes": bytes(range(256)) * 8, "a truncated body": valid[: len(valid) // 2],
                      "zstd with bytes after its frame": zstandard.ZstdCompressor().compress(valid) + b"junk"}
        for what, content in unreadable.items():
            missing = run.next_seq_id()
            encoding = "zstd" if what.startswith("zstd") else None
            assert run.forward(content, encoding).status_code == 400, what
            started = time.monotonic()
            behind = run.result(run.forward(run.forward_body(run.next_seq_id())).json()["request_id"])
            assert f"seq_id {missing} of {run.model_id} never arrived" in behind["error"], what
            assert time.monotonic() - started < GAP_SECONDS + 30
            assert isinstance(run.result(run.forward(run.forward_body(run.next_seq_id())).json()["request_id"]), bytes)


def _pending_futures(server: LiveServer) -> int:
    with sqlite3.connect(f"file:{server.data_dir / 'server.db'}?mode=ro", uri=True) as journal:
        return journal.execute("SELECT count(*) FROM futures WHERE status = 'pending'").fetchone()[0]
