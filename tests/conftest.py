"""Shared test fixtures."""

import logging
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg import sql
import pytest
import sqlalchemy as sa

REPO_ROOT = Path(__file__).resolve().parents[1]

# SDK clients of servers that a finished test stopped go on heartbeating for the rest of the run; their
# warnings would bury a failure's own output.
logging.getLogger("tinker.lib.internal_client_holder").setLevel(logging.ERROR)


# The longest groups of tests go first, so that neither of scripts/test.sh's two workers is left with one at the
# end; everything else follows in file order.
_FIRST = ("tests/vllm/", "tests/e2e/test_real_model.py", "tests/e2e/", "tests/fault/test_crashes_and_full_disk.py",
          "tests/integration/test_cookbook_recipes.py", "tests/integration/test_readme.py",
          "tests/unit/training/test_trainer.py")


def _group(nodeid: str) -> str:
    """The tests a worker runs together: a module's (its module-scoped servers start once), and all of tests/vllm
    (they share their vLLM engines)."""
    path = nodeid.split("::")[0]
    return "tests/vllm/" if path.startswith("tests/vllm/") else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i for i, prefix in enumerate(_FIRST) if item.nodeid.startswith(prefix)), len(_FIRST))

    items.sort(key=rank)  # stable: file order within a rank


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist hands out whole groups (its own xdist_group marks do not reach pytest 9's node ids)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache of built-in tiny models for the whole test run; each is built on first use."""
    return tmp_path_factory.mktemp("builtin-models")

# ---------------------------------------------------------------------------------------------
# Databases: every store test runs on a SQLite file and on a real PostgreSQL server.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL database URL: $TEST_POSTGRES_URL, else a cluster started for this test run."""
    if url := os.environ.get("TEST_POSTGRES_URL"):
        yield url
        return
    script = REPO_ROOT / "scripts" / "start_test_postgres.sh"
    # Our own directory rather than tmp_path_factory's: the postgres user must be able to enter it.
    data_dir = tempfile.mkdtemp(prefix="tinker-test-postgres-")
    started = subprocess.run([script, data_dir], capture_output=True, text=True)
    if started.returncode != 0:
        shutil.rmtree(data_dir, ignore_errors=True)
        pytest.fail(f"could not start PostgreSQL with {script}:\n{started.stderr[-4000:]}", pytrace=False)
    try:
        yield started.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run([script, "--stop", data_dir], capture_output=True)
        shutil.rmtree(data_dir, ignore_errors=True)


def _postgres_admin_connection(url: sa.URL) -> psycopg.Connection:
    # CREATE/DROP DATABASE cannot run inside a transaction.
    return psycopg.connect(
        host=url.host, port=url.port, user=url.username, password=url.password, dbname=url.database, autocommit=True
    )


# The backends the store tests run on: both, but in the quick tier (scripts/test.sh --quick), which needs no
# database server.
DATABASES = os.environ.get("TEST_DATABASES", "sqlite,postgresql").split(",")


@pytest.fixture(params=DATABASES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL of a fresh, empty database, once per backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/server.db"
        return
    server_url = sa.make_url(request.getfixturevalue("postgres_url"))
    name = f"test_{uuid.uuid4().hex}"
    with _postgres_admin_connection(server_url) as connection:
        connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield server_url.set(database=name).render_as_string(hide_password=False)
    with _postgres_admin_connection(server_url) as connection:
        connection.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
