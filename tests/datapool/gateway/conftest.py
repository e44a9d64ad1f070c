"""Fixtures of the gateway tests: one tiny in-process engine per session and a fresh SQLite pool per test."""
from __future__ import annotations

import pytest
from gateway_helpers import tiny_engine

from datapool.store import DataPool


@pytest.fixture(scope="session")
def engine_and_tokenizer(tiny_policy_dir):
    return tiny_engine(tiny_policy_dir)


@pytest.fixture
def pool(tmp_path):
    with DataPool(f"sqlite:///{tmp_path / 'pool.db'}") as p:
        yield p
