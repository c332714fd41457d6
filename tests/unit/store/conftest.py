"""The store under test: a fresh one per test, on SQLite and on PostgreSQL (see the database_url fixture)."""

from collections.abc import Iterator

import pytest

from server.store.store import Store


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    store = Store(database_url)
    yield store
    store.close()
