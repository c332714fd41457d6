"""`python -m server --base-model NAME [...]`: parse the flags, build the app, serve it.
`python -m server keys create|list|revoke ...`: manage API keys (server/keys.py).
`python -m server adapters import PATH --tenant NAME`: import a PEFT adapter (server/adapter_imports.py).
`python -m server export --merged tinker://... --out DIR`: base model plus adapter (server/merged_export.py)."""

import collections
import functools
import gc
import logging
import os
import socket
import sys
import time

import uvicorn

from server.config import (ServerConfig, build_arg_parser, parse_adapters_command, parse_config, parse_export_command,
                           parse_keys_command)

# Long polls hold a connection up to 30 s: on SIGTERM they get this long, then the scheduler's own
# bounded shutdown runs (server/app.py).
OPEN_CONNECTIONS_GRACE_SECONDS = 3


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server, saying "Ready" once its socket accepts requests (after the model is loaded)."""

    def __init__(self, config: uvicorn.Config, server_config: ServerConfig, started: float):
        super().__init__(config)
        self.server_config, self.started_at = server_config, started

    def stop_serving(self) -> None:
        """Shut down as on SIGTERM, from any thread (uvicorn's loop looks at the flag several times a second)."""
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            from server.banner import ready_line, server_url
            from server.heap import freeze_startup_objects

            freeze_startup_objects()
            seconds = time.monotonic() - self.started_at
            print(ready_line(self.server_config, seconds), flush=True)
            logging.getLogger("server").info("event=ready url=%s seconds=%.1f frozen_objects=%d",
                                             server_url(self.server_config), seconds, gc.get_freeze_count())


def bind(host: str, port: int) -> socket.socket:
    """The listening address, taken before the model loads: a port in use fails now, not minutes later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP by name: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets that say so,
    # and with it on, a response's body waits for the client's delayed ACK of its headers (40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {error.strerror}; is another server there? "
                         f"Choose another --port or --host.") from None
    return sock


def main() -> None:
    if sys.argv[1:2] == ["keys"]:
        from server.keys import run_keys_command

        sys.exit(run_keys_command(parse_keys_command(sys.argv[2:])))
    if sys.argv[1:2] == ["adapters"]:
        from server.adapter_imports import run_adapters_command

        sys.exit(run_adapters_command(parse_adapters_command(sys.argv[2:])))
    if sys.argv[1:2] == ["export"]:
        from server.merged_export import run_export_command

        sys.exit(run_export_command(parse_export_command(sys.argv[2:])))
    started = time.monotonic()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    try:
        config = parse_config()
    except ValueError as error:
        build_arg_parser().error(str(error))
    sock = bind(config.host, config.port)
    logging.getLogger("server").info("event=starting base_model=%s data_dir=%s (loading libraries, then the model)",
                                     config.model.base_model, config.data_dir)
    from server.app import create_app

    app = create_app(config)
    from server.direct_routes import DirectRoutesProtocol

    http = functools.partial(DirectRoutesProtocol, limits=config.limits, open_by_address=collections.Counter(),
                             routes=app)
    server = AnnouncingServer(uvicorn.Config(app, log_level="warning", http=http,
                                             timeout_graceful_shutdown=OPEN_CONNECTIONS_GRACE_SECONDS),
                              config, started)
    app.state.stop_serving = server.stop_serving  # for a server that must stop on its own (a training rank died)
    server.run(sockets=[sock])
    if message := getattr(app.state, "exit_message", None):
        # It stopped on its own (a training rank died): a supervisor sees a failure, the operator what to do.
        print(message, file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(1)
    if getattr(app.state, "abandoned_threads", False):
        # A request still running past --shutdown-timeout-seconds was failed in the journal; its thread would
        # otherwise hold the interpreter's exit until it ends.
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
