"""`python -m server --base-model NAME [...]`: parse the flags, build the app, serve it."""

import logging

import uvicorn

from server.app import create_app
from server.config import parse_config


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_config()
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="warning")


if __name__ == "__main__":
    main()
