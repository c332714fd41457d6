"""One server per data directory and per database: a second one refuses to start.

Two servers on one journal would each fail the other's in-flight futures at startup and run the
same seq_ids twice. The data directory and a SQLite journal's real file (whatever path, symbolic link
or URL reaches it) are held with an exclusive `flock`, a PostgreSQL database with a session-level
advisory lock (advisory locks belong to the database, whatever URL reaches it); the operating system
or the database releases both when the process dies, even by kill -9, so nothing stale is left behind.
"""

import fcntl
import os
from pathlib import Path

import sqlalchemy as sa

from server.store.db import sqlite_journal_file

# Any fixed number; it only has to be the same for every server on one database.
_OWNER_LOCK_KEY = 0x7469_6E6B_6572_02


class AlreadyServed(RuntimeError):
    """Another server holds this data directory or database."""


class Ownership:
    """The locks that make this process the one server of its data directory and database."""

    def __init__(self, data_dir: Path, engine: sa.Engine):
        self._files = []
        self._connection: sa.Connection | None = None
        self._hold_file(data_dir / "server.lock", f"data directory {data_dir}", "--data-dir")
        url = engine.url
        if (journal := sqlite_journal_file(url)) is not None:
            # Beside the real file, even in the data directory: another server may name it with --database-url.
            self._hold_file(journal.with_name(journal.name + ".lock"), f"database {journal}", "--database-url")
        elif url.get_backend_name() == "postgresql":
            self._connection = engine.connect()
            held = self._connection.execute(sa.text("SELECT pg_try_advisory_lock(:key)"),
                                            {"key": _OWNER_LOCK_KEY}).scalar()
            self._connection.commit()
            if not held:
                self.release()
                raise AlreadyServed(f"another server already uses the database {url.render_as_string()}: stop it "
                                    f"first (one server per database)")

    def _hold_file(self, path: Path, what: str, flag: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            self.release()
            raise AlreadyServed(f"another server (pid {holder}) already uses the {what}: stop it first, or start "
                                f"this one with another {flag}") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._files.append(handle)

    def release(self) -> None:
        for handle in self._files:
            handle.close()
        self._files.clear()
        if self._connection is not None:
            # The connection goes back to the pool with its session, so let go of the lock explicitly.
            self._connection.invalidate()
            self._connection.close()
            self._connection = None
