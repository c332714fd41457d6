"""The sampling hot path's two routes served by the HTTP protocol itself, without ASGI.

Every sample the SDK takes is two POSTs (`asample`, then `retrieve_future`, long-polled), thousands a second in
RL, and uvicorn's ASGI cycle (a scope, a request-response cycle, receive and send) costs about as much as the
routes' own work. For those two paths (HTTP/1.1 POST, no `Expect: 100-continue`) the connection keeps the body
as it is parsed, runs the routes' logic (`HotRoutes.answer`, the same as on the ASGI path) as one task once the
message is complete, and writes the whole response at once. Any other request goes on through uvicorn's ASGI
path; on one connection, requests are answered in order (a pipelined one waits in uvicorn's queue).
Knows the routes by their paths only.
"""

from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from server.api.deps import refuse_large_body
from server.connections import GuardedHttpProtocol


class DirectCall:
    """One request served here: what uvicorn's protocol knows as the connection's `cycle` (its pipeline holds
    these beside its own), and what the routes read as a `HotCall`."""

    def __init__(self, path: str, headers: dict[str, str], keep_alive: bool, limit: int):
        self.path, self.headers, self.keep_alive, self.limit = path, headers, keep_alive, limit
        self.chunks: list[bytes] = []
        self.size = 0
        """Bytes of body that arrived; only the first `limit` are kept."""
        self.complete = False
        """The whole message arrived."""
        self.lost = False
        """The connection closed before it did."""
        self.queued = False
        """Waits for an earlier request on its connection to be answered."""
        self.response_complete = False

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size <= self.limit:
            self.chunks.append(chunk)

    async def body(self) -> bytes:
        if self.lost:
            raise ClientDisconnect()
        refuse_large_body(None, self.size, self.limit)  # a declared length over it went the ASGI way
        return b"".join(self.chunks)


class DirectRoutesProtocol(GuardedHttpProtocol):
    """A guarded HTTP connection that answers the hot routes itself.

    Args:
        routes: the app's `HotRoutes`: its `routes` name the paths, its `answer(path, call)` makes a response.
    """

    def __init__(self, *args: Any, routes: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.routes = routes
        self.paths = {path.encode(): path for path in routes.routes}

    def on_headers_complete(self) -> None:
        path = self.paths.get(self.url)
        if (path is None or self.parser.get_method() != b"POST" or self.expect_100_continue
                or self.parser.get_http_version() != "1.1" or self.parser.should_upgrade()):
            return super().on_headers_complete()
        # Names are lowercase already; reversed, so that the first of a repeated header wins (as in Starlette).
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in reversed(self.headers)}
        limit = self.limits.max_request_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # the ASGI path refuses it before its body comes
            return super().on_headers_complete()
        self._arm(self.limits.body_timeout_seconds)
        call = DirectCall(path, headers, self.parser.should_keep_alive(), limit)
        earlier, self.cycle = self.cycle, call
        if earlier is not None and not earlier.response_complete:  # uvicorn starts it when its turn comes
            call.queued = True
            self.flow.pause_reading()
            self.pipeline.appendleft((call, None))

    def on_body(self, body: bytes) -> None:
        if not isinstance(self.cycle, DirectCall):
            return super().on_body(body)
        self._arm(self.limits.body_timeout_seconds)
        self.cycle.add(body)

    def on_message_complete(self) -> None:
        call = self.cycle
        if not isinstance(call, DirectCall):
            return super().on_message_complete()
        self._disarm()
        call.complete = True
        if not call.queued:
            self._start(call)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        """uvicorn's hook for the next request of the pipeline, once the one before it was answered."""
        if not isinstance(cycle, DirectCall):
            return super()._start_asgi_task(cycle, app)
        cycle.queued = False
        if cycle.complete:
            self._start(cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        call = self.cycle
        if isinstance(call, DirectCall):
            self.cycle = None  # uvicorn's own clean-up is for its cycles
            if not call.complete and not call.queued:
                # The ASGI path would be reading this body now, and answer its loss 400 to no one: the metrics
                # count it the same.
                call.lost = True
                self._start(call)
        super().connection_lost(exc)

    def _start(self, call: DirectCall) -> None:
        task = self.loop.create_task(self._answer(call))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)  # uvicorn's shutdown waits for these

    async def _answer(self, call: DirectCall) -> None:
        response = await self.routes.answer(call.path, call)
        if self.flow.write_paused:  # the client is slow to read what was written before
            await self.flow.drain()
        if self.transport.is_closing():
            return
        call.response_complete = True
        self.transport.write(_rendered(response, self.server_state.default_headers, call.keep_alive))
        if not call.keep_alive:
            self.transport.close()
        self.on_response_complete()


def _rendered(response: Response, default_headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes:
    """A whole HTTP/1.1 response, as uvicorn would write it for this Starlette response."""
    parts = [STATUS_LINE[response.status_code]]
    for name, value in (*default_headers, *response.raw_headers):
        parts += [name, b": ", value, b"\r\n"]
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts += [b"\r\n", response.body]
    return b"".join(parts)
