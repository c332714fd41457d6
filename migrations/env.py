"""Alembic environment: migrates one database to the tables declared in server.store.rows.

The server passes an open connection in config.attributes["connection"] (server.store.db);
the alembic command line passes the `sqlalchemy.url` option instead.
"""

import sqlalchemy as sa
from alembic import context

from server.store.rows import Base

config = context.config
target_metadata = Base.metadata


def render_item(kind: str, obj: object, autogen_context: object) -> str | bool:
    """Write a row module's column type as its plain SQLAlchemy type, so revisions never import server code."""
    if kind == "type" and isinstance(obj, sa.TypeDecorator):
        return f"sa.{obj.impl!r}"
    return False


def run_migrations(connection: sa.Connection) -> None:
    """Run the pending migrations on an open connection."""
    # Batch mode lets autogenerate write ALTERs that SQLite can run (it copies the table).
    context.configure(
        connection=connection, target_metadata=target_metadata, render_as_batch=True, render_item=render_item
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif "connection" in config.attributes:
    run_migrations(config.attributes["connection"])
else:
    engine = sa.create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as connection:
        run_migrations(connection)
    engine.dispose()
