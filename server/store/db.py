"""The database engine: connection settings per backend and schema migration at startup.

Knows SQLite (the embedded default) and PostgreSQL (several replicas); knows nothing about
the tables beyond handing migrations/ to Alembic, which owns every schema change.
"""

import errno
import os
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from server.errors import InsufficientStorage, StorageUnavailable, TinkerServerError

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
SUPPORTED_BACKENDS = ("sqlite", "postgresql")
# Any fixed number works; it only has to be the same in every replica.
_MIGRATION_LOCK_KEY = 0x7469_6E6B_6572


def build_engine(database_url: str) -> sa.Engine:
    """Create the one engine a process shares between threads."""
    url = sa.make_url(database_url)
    backend = url.get_backend_name()
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"unsupported database {backend!r}; use one of {SUPPORTED_BACKENDS}")
    # asyncio.to_thread's default executor runs up to 32 store calls at once;
    # pre-ping replaces connections that a PostgreSQL restart has closed.
    engine = sa.create_engine(url, pool_size=8, max_overflow=24, pool_pre_ping=backend == "postgresql")
    if backend == "sqlite":
        sa.event.listen(engine, "connect", _configure_sqlite_connection)
    return engine


def _configure_sqlite_connection(dbapi_connection, _connection_record) -> None:
    # WAL lets readers run beside the one writer; writers wait up to 30 s for the lock
    # instead of failing at once with "database is locked".
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def upgrade_to_head(engine: sa.Engine) -> None:
    """Apply every pending Alembic migration; a no-op when the schema is current."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            # Replicas starting together migrate one at a time; the later ones find head and stop.
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def has_server_database(database_url: str) -> bool:
    """Whether the URL holds a database a server made (its migrations ran there); creates nothing."""
    url = sa.make_url(database_url)
    if url.get_backend_name() == "sqlite" and not (url.database and Path(url.database).is_file()):
        return False  # connecting would create the file
    engine = build_engine(database_url)
    try:
        return sa.inspect(engine).has_table("alembic_version")
    finally:
        engine.dispose()


FULL_DISK_FREE_BYTES = 1 << 20
"""A file system with less room than this is full (healthz says "degraded")."""


def has_no_room(directory: Path) -> bool:
    """Whether the file system that holds (or will hold) `directory` is full."""
    while not directory.exists() and directory.parent != directory:
        directory = directory.parent
    try:
        usage = os.statvfs(directory)
    except OSError:
        return False
    return usage.f_bavail * usage.f_frsize < FULL_DISK_FREE_BYTES


def sqlite_journal_file(url: sa.URL) -> Path | None:
    """The real file of a SQLite journal (symbolic links resolved), whatever path reached it; None for a database
    server or an in-memory database."""
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).resolve()


def is_disk_full(error: BaseException) -> bool:
    """Whether a filesystem or database error means "no space left" (SQLite, PostgreSQL, or the OS)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error).lower()
        if "database or disk is full" in text or "no space left" in text or "could not extend file" in text:
            return True
        error = getattr(error, "orig", None) or error.__cause__
    return False


def storage_failure(error: BaseException, action: str) -> TinkerServerError:
    """The client-facing error for a failed write: what could not be done, and why, without server paths."""
    if is_disk_full(error):
        return InsufficientStorage(f"the server's disk is full, so it could not {action}; nothing of it was kept. "
                                   f"Send it again once the operator has freed space")
    reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
    return StorageUnavailable(f"storage error ({reason}): the server could not {action}; send it again")
