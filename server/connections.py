"""HTTP connections that no one can hold open for nothing, before any key is checked.

uvicorn's httptools protocol with three bounds it lacks (it only closes a kept-alive connection that
stays idle between requests): a request's headers must arrive within `header_timeout_seconds` of its
first byte (or of the connection, for the first request), its body must keep arriving (at most
`body_timeout_seconds` between two reads), and one client address keeps at most
`max_connections_per_client` connections open; one more is answered 503 (the SDK retries it) and closed.
Knows nothing of routes or tenants: it runs before either.
"""

import asyncio
import json
from collections import Counter
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.config import LimitsConfig


def _response(status: str, message: str) -> bytes:
    """A whole HTTP response that closes the connection, in the Tinker error body's shape."""
    body = json.dumps({"detail": message, "error": message, "category": "server"}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """One HTTP connection, closed when its client stalls mid-request or has too many open."""

    def __init__(self, *args: Any, limits: LimitsConfig, open_by_address: Counter, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits, self.open_by_address = limits, open_by_address
        self.address: str | None = None
        """The client address this connection is counted under (None: not counted)."""
        # One timer per connection, moved only when a bound must end sooner: arming a bound (every parse event)
        # sets `deadline`, and the timer, when it fires early, waits again for the rest.
        self.deadline: float | None = None
        """The loop time at which the bound running now ends (None: none runs)."""
        self.bound_seconds = 0.0
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else None
        limit = self.limits.max_connections_per_client
        if address is not None and self.open_by_address[address] >= limit:
            transport.write(_response("503 Service Unavailable", f"this address has {limit} connections open to "
                                      f"the server, the limit (--max-connections-per-client); close some"))
            transport.close()
            return
        if address is not None:
            self.address = address
            self.open_by_address[address] += 1
        self._arm(self.limits.header_timeout_seconds)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.address is not None:
            self.open_by_address[self.address] -= 1
            if not self.open_by_address[self.address]:
                del self.open_by_address[self.address]
            self.address = None
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.limits.header_timeout_seconds)

    def on_headers_complete(self) -> None:
        self._arm(self.limits.body_timeout_seconds)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._arm(self.limits.body_timeout_seconds)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self, seconds: float) -> None:
        self.deadline, self.bound_seconds = self.loop.time() + seconds, seconds
        if self.timer is None or self.timer.when() > self.deadline:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_at(self.deadline, self._check)

    def _disarm(self) -> None:
        self.deadline = None

    def _check(self) -> None:
        self.timer = None
        if self.deadline is None:
            return
        if self.loop.time() < self.deadline:  # re-armed since: wait for the rest
            self.timer = self.loop.call_at(self.deadline, self._check)
            return
        self._expire(self.bound_seconds)

    def _expire(self, seconds: float) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the app has not taken the body it was sent yet: the client is not late
            self._arm(seconds)
            return
        if self.cycle is None or self.cycle.response_complete:  # no request running: say why, then close
            self.transport.write(_response("408 Request Timeout", f"the request's headers did not arrive within "
                                           f"{seconds:g} s (--header-timeout-seconds)"))
        self.transport.close()
