"""Data pool fixtures: ``pool_url`` / ``pool`` run a test on SQLite (WAL) and on a real PostgreSQL server (the
session's throwaway server from tests/servers.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from datapool.store import DataPool

BACKENDS = ("sqlite", "postgres")


@pytest.fixture(params=BACKENDS)
def pool_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty data pool: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'pool.db'}"
    return request.getfixturevalue("postgres_database")()


@pytest.fixture
def pool(pool_url: str) -> Iterator[DataPool]:
    with DataPool(pool_url) as p:
        yield p
