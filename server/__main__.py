"""`python -m server --base-model NAME [...]`: parse the flags, build the app, serve it.
`python -m server keys create|list|revoke ...`: manage API keys (server/keys.py)."""

import logging
import os
import sys

import uvicorn

from server.config import build_arg_parser, parse_config, parse_keys_command

# Long polls hold a connection up to 30 s: on SIGTERM they get this long, then the scheduler's own
# bounded shutdown runs (server/app.py).
OPEN_CONNECTIONS_GRACE_SECONDS = 3


def main() -> None:
    if sys.argv[1:2] == ["keys"]:
        from server.keys import run_keys_command

        sys.exit(run_keys_command(parse_keys_command(sys.argv[2:])))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = parse_config()
    except ValueError as error:
        build_arg_parser().error(str(error))
    from server.app import create_app

    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning",
                timeout_graceful_shutdown=OPEN_CONNECTIONS_GRACE_SECONDS)
    if getattr(app.state, "abandoned_threads", False):
        # A request still running past --shutdown-timeout was failed in the journal; its thread would
        # otherwise hold the interpreter's exit until it ends.
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
