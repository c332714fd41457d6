"""A training run driven by raw HTTP, for tests that choose every seq_id themselves (the SDK numbers its own)."""

import httpx
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from server.wire import tinker_public_pb2 as pb
from support.live_server import BASE_MODEL


class RawRun:
    """One run: create it, send forward_backward bodies (valid or mangled), poll results."""

    def __init__(self, http: httpx.Client, base_model: str = BASE_MODEL):
        self.http = http
        self.session_id = session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        created = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                           "base_model": base_model, "lora_config": {"rank": 4}})
        self.model_id = self.result(created.json()["request_id"])["model_id"]
        self.seq_id = 0

    def result(self, request_id: str) -> dict | bytes:
        while (poll := self.http.post("/api/v1/retrieve_future", json={"request_id": request_id})).status_code == 408:
            pass
        assert poll.status_code == 200, poll.text
        return poll.json() if poll.headers["content-type"].startswith("application/json") else poll.content

    def forward_body(self, seq_id: int, chunks: list | None = None) -> bytes:
        tokens = [5, 6, 7, 8]
        data = [types.Datum(model_input=types.ModelInput.from_ints(tokens),
                            loss_fn_inputs={"target_tokens": tokens, "weights": [1.0] * 4})]
        message = pb.ForwardBackwardRequest.FromString(forward_backward_request_to_proto(types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=self.model_id, seq_id=seq_id)).SerializeToString())
        for chunk in chunks or []:
            message.data[0].model_input.append(chunk)
        return message.SerializeToString()

    def forward(self, content: bytes, encoding: str | None = None) -> httpx.Response:
        headers = {"Content-Type": "application/x-protobuf", **({"Content-Encoding": encoding} if encoding else {})}
        return self.http.post("/api/v1/forward_backward", content=content, headers=headers)

    def next_seq_id(self) -> int:
        self.seq_id += 1
        return self.seq_id
