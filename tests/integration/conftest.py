"""Fixtures of the SDK suite: one live server per database backend, shared by the tests.

Every server of a test run shares the run's built-in model cache, so each tiny model is built once.
"""

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
import tinker
from psycopg import sql

from support.live_server import LiveServer, start_server


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def backend_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh journal database per backend, for the whole SDK suite."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('sqlite')}/server.db"
        return
    yield from _fresh_postgres_database(request)


def _fresh_postgres_database(request: pytest.FixtureRequest) -> Iterator[str]:
    server_url = sa.make_url(request.getfixturevalue("postgres_url"))
    name = f"sdk_{uuid.uuid4().hex}"
    connect = dict(host=server_url.host, port=server_url.port, user=server_url.username,
                   password=server_url.password, dbname=server_url.database, autocommit=True)
    with psycopg.connect(**connect) as connection:
        connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield server_url.set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(**connect) as connection:
        connection.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def server(backend_url: str, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One live server per database backend, shared by the SDK suite."""
    live = start_server(tmp_path_factory.mktemp("server"), backend_url, models_dir)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def service_client(server: LiveServer) -> tinker.ServiceClient:
    return server.service_client()


@pytest.fixture(scope="session")
def lifecycle_server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server (SQLite) that looks for expired checkpoints every second: weights out, the checkpoint
    lifecycle and the conformance checker run against it."""
    live = start_server(tmp_path_factory.mktemp("lifecycle"), None, models_dir, "--checkpoint-sweep-interval", "1")
    yield live
    live.stop()


@pytest.fixture(scope="session")
def first_start_server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The README's server, started as a new user starts it: an empty data directory, so its banner shows
    the first API key. The README's tutorial and the dashboard's browser test run against it."""
    live = start_server(tmp_path_factory.mktemp("first-start"), None, models_dir, "--seq-gap-timeout", "600",
                        base_model="builtin:tiny-qwen2-vl")
    yield live
    live.stop()
