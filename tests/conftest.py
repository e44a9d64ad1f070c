"""Shared fixtures: a tiny tokenizer + Qwen2 policy built once per session into a temporary folder."""
from __future__ import annotations

import os

import pytest

pytest_plugins = ["tests.servers"]  # PostgreSQL and S3 servers, one per session

ENV_LIKE_TEXTS = [
    f"You are in the kitchen (room {i}). Exits: north, east.\n"
    f"Inventory: {i % 5} coins, a lamp.\n> take key {i * 7}\nYou take the key. Score: {i * 3}/100.\n"
    f"  Café naïve – déjà vu: {i}.5%\ttab\n\n"
    for i in range(200)
]


@pytest.fixture(scope="session")
def env_like_texts() -> list[str]:
    """Text that looks like env observations and actions: newlines, runs of spaces, tabs, digits, accents."""
    return list(ENV_LIKE_TEXTS)


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """Folder with a ~0.3M-parameter Qwen2 model and its BPE tokenizer (save_policy format)."""
    from models.build import TinyModelConfig, build_model, save_policy, train_tokenizer

    tokenizer = train_tokenizer(ENV_LIKE_TEXTS, vocab_size=320)
    model = build_model(tokenizer, TinyModelConfig(arch="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position_embeddings=256), seed=0)
    return save_policy(model, tokenizer, tmp_path_factory.mktemp("policy") / "tiny")


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """A temporary Prefect server/database for the flows under test (Prefect's own test harness), one per session."""
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def pytest_collection_modifyitems(session, config, items):
    """Longest test files first (tests/durations.py): xdist hands whole files to workers in this order."""
    from pathlib import Path

    from tests.durations import load, order_by_duration

    order_by_duration(items, Path(config.rootpath), load())
