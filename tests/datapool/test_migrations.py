"""Version 4 -> 8: a pool and a steps file written before the skill trace (5), the constrained-decoding mask (6),
the prefix_break flag (7) and the staleness count (8) became step fields still open and read.

The version-4 tables are the exact DDL arlflow 4 created (``CREATE TABLE`` as SQLAlchemy compiled it for each
backend), filled with raw SQL; the version-4 Parquet layout is its hand-written Arrow schema. Pool tests run on
SQLite and on a real PostgreSQL server (tests/datapool/conftest.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import create_engine, inspect, text

from datapool.parquet import STEPS_SCHEMA, export_steps, import_steps, read_steps
from datapool.records import STEP_FIELDS
from datapool.store import SCHEMA_VERSION, DataPool, encode_ids, encode_logprobs
from tests.datapool.records_helpers import full_trajectory

_V4_COMMON = """
CREATE TABLE schema_version (id INTEGER NOT NULL, version INTEGER NOT NULL, PRIMARY KEY (id));
CREATE TABLE trajectories (
    trajectory_id TEXT NOT NULL, group_id TEXT NOT NULL, scenario TEXT NOT NULL, env TEXT NOT NULL,
    split TEXT NOT NULL, round INTEGER NOT NULL, policy_version TEXT NOT NULL, status TEXT NOT NULL,
    episode_return {float} NOT NULL, won BOOLEAN NOT NULL, num_steps INTEGER NOT NULL,
    response_tokens INTEGER NOT NULL, wall_time_s {float} NOT NULL, error TEXT, metadata JSON NOT NULL,
    created_at {float} DEFAULT 0 NOT NULL, PRIMARY KEY (trajectory_id));
CREATE INDEX ix_trajectories_round ON trajectories (round);
CREATE INDEX ix_trajectories_created_at ON trajectories (created_at);
CREATE INDEX ix_trajectories_group_id ON trajectories (group_id);
CREATE INDEX ix_trajectories_env ON trajectories (env);
CREATE TABLE curation (
    id {serial} NOT NULL, kind TEXT NOT NULL, trajectory_id TEXT NOT NULL, step_index INTEGER,
    excluded BOOLEAN NOT NULL, label TEXT, note TEXT NOT NULL, updated_at {float} NOT NULL, PRIMARY KEY (id),
    FOREIGN KEY(trajectory_id) REFERENCES trajectories (trajectory_id));
CREATE UNIQUE INDEX uq_curation_target ON curation (trajectory_id, coalesce(step_index, -1));
CREATE TABLE requests (
    idempotency_key TEXT NOT NULL, trajectory_id TEXT NOT NULL, step_index INTEGER NOT NULL, response JSON,
    created_at {float} NOT NULL, PRIMARY KEY (idempotency_key),
    FOREIGN KEY(trajectory_id) REFERENCES trajectories (trajectory_id));
CREATE TABLE steps (
    id {serial} NOT NULL, trajectory_id TEXT NOT NULL, group_id TEXT NOT NULL, step_index INTEGER NOT NULL,
    prompt_ids {blob} NOT NULL, response_ids {blob} NOT NULL, logprobs {blob} NOT NULL, prompt_text TEXT NOT NULL,
    observation TEXT NOT NULL, action TEXT NOT NULL, response_text TEXT NOT NULL, reward {float} NOT NULL,
    anchor TEXT NOT NULL, policy_version TEXT NOT NULL, action_valid BOOLEAN NOT NULL, truncated BOOLEAN NOT NULL,
    skill_ids JSON NOT NULL, context_manager TEXT NOT NULL, tool_calls INTEGER DEFAULT 0 NOT NULL,
    tool_successes INTEGER DEFAULT 0 NOT NULL, process_reward {float} DEFAULT 0 NOT NULL,
    retokenized BOOLEAN DEFAULT FALSE NOT NULL, PRIMARY KEY (id),
    CONSTRAINT uq_steps_trajectory_step UNIQUE (trajectory_id, step_index),
    FOREIGN KEY(trajectory_id) REFERENCES trajectories (trajectory_id));
"""
V4_DDL = {"sqlite": _V4_COMMON.format(float="DOUBLE", serial="INTEGER", blob="BLOB"),
          "postgresql": _V4_COMMON.format(float="DOUBLE PRECISION", serial="SERIAL", blob="BYTEA")}
"""The version-4 tables, as arlflow 4's ``create_all`` made them on each backend."""


def _write_v4_pool(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        for statement in V4_DDL[engine.dialect.name].split(";"):
            if statement.strip():
                conn.exec_driver_sql(statement)
        conn.execute(text("INSERT INTO schema_version VALUES (1, 4)"))
        conn.execute(text(
            "INSERT INTO trajectories VALUES ('old', 'g0', '{}', 'frozenlake', 'train', 2, 'v0', 'complete', 1.0, "
            "TRUE, 2, 4, 0.5, NULL, '{\"seed\": 3}', 1700000000.0)"))
        for k in range(2):
            conn.execute(text(
                "INSERT INTO steps (trajectory_id, group_id, step_index, prompt_ids, response_ids, logprobs, "
                "prompt_text, observation, action, response_text, reward, anchor, policy_version, action_valid, "
                "truncated, skill_ids, context_manager, tool_calls, tool_successes, process_reward, retokenized) "
                "VALUES ('old', 'g0', :k, :p, :r, :l, 'p', 'o', 'up', ' up', 0.5, 'a', 'v0', TRUE, FALSE, "
                "'[\"walk\"]', 'full', 1, 1, 0.1, FALSE)"),
                {"k": k, "p": encode_ids([1, 2, k]), "r": encode_ids([3, 4]), "l": encode_logprobs([-0.5, -0.25])})
        conn.execute(text("INSERT INTO curation (kind, trajectory_id, step_index, excluded, label, note, updated_at) "
                          "VALUES ('step', 'old', 1, TRUE, 'bad', 'n', 1.0)"))
        conn.execute(text("INSERT INTO requests VALUES ('key-1', 'old', 1, '{\"id\": \"x\"}', 1.0)"))
    engine.dispose()


def _columns(url: str) -> dict[str, dict[str, tuple]]:
    """table -> column -> (type, nullable, has a default) of a pool's trajectories and steps tables."""
    engine = create_engine(url)
    try:
        found = inspect(engine)
        return {table: {c["name"]: (str(c["type"]), c["nullable"], c["default"] is not None)
                        for c in found.get_columns(table)} for table in ("trajectories", "steps")}
    finally:
        engine.dispose()


def _fresh_url(pool_url: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if pool_url.startswith("sqlite"):
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    return request.getfixturevalue("postgres_database")()


def test_a_version_4_pool_opens_migrated_to_8_and_reads(pool_url: str, request: pytest.FixtureRequest,
                                                         tmp_path: Path) -> None:
    _write_v4_pool(pool_url)
    assert SCHEMA_VERSION == 8
    with DataPool(pool_url) as pool:
        with pool.engine.connect() as conn:
            assert conn.execute(text("SELECT version FROM schema_version")).scalar() == 8
        old = pool.get_trajectory("old")
        assert [s.prompt_ids for s in old.steps] == [[1, 2, 0], [1, 2, 1]] and old.won and old.round == 2
        assert all(s.plain_prompt_ids == [] and s.macro_prompt_ids == [] and s.macro_action_ids == []
                   for s in old.steps)  # older steps: no skill trace
        assert all(s.action_choices == [] for s in old.steps)  # and free decoding
        assert all(s.prefix_break is False for s in old.steps)  # and unflagged
        assert all(s.staleness == 0 for s in old.steps)  # and sampled on-policy
        assert old.steps[0].tool_calls == 1 and old.steps[0].process_reward == pytest.approx(0.1)
        frame = pool.steps_frame()
        assert frame["excluded"].tolist() == [False, True]  # curation kept
        assert frame["plain_prompt_ids"].tolist() == [[], []]
        assert pool.lookup_request("key-1") == {"id": "x"}
        assert pool.query_trajectories()[0]["created_at"] == 1700000000.0
        # new writes carry the trace, both ways in
        assert pool.add_trajectories([full_trajectory()]) == 1
        assert pool.get_trajectory("full") == full_trajectory()
        pool.open_trajectory("live", group_id="g", policy_version="v3")
        pool.append_step(full_trajectory("live").steps[0])
        assert pool.get_trajectory("live").steps[0].macro_action_ids == [[9, 0], [10, 0], [11]]
        assert pool.export(tmp_path / "s.parquet") == 5
    with DataPool(pool_url) as again:  # opening a migrated pool is a no-op
        assert again.counts() == {"trajectories": 3, "steps": 5}
    with DataPool(_fresh_url(pool_url, request, tmp_path)) as fresh:
        fresh_columns = _columns(fresh.url)
    migrated = _columns(pool_url)
    assert migrated == fresh_columns  # the same tables as a pool created today
    df, _ = read_steps(tmp_path / "s.parquet")
    assert df.loc[df["trajectory_id"] == "old", "plain_prompt_ids"].tolist() == [[], []]


V4_STEPS_SCHEMA = pa.schema([
    pa.field("trajectory_id", pa.string(), nullable=False), pa.field("group_id", pa.string(), nullable=False),
    pa.field("step_index", pa.int32(), nullable=False), pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False), pa.field("prompt_text", pa.string()),
    pa.field("observation", pa.string()), pa.field("action", pa.string()), pa.field("response_text", pa.string()),
    pa.field("reward", pa.float64()), pa.field("anchor", pa.string()), pa.field("policy_version", pa.string()),
    pa.field("action_valid", pa.bool_()), pa.field("truncated", pa.bool_()),
    pa.field("skill_ids", pa.list_(pa.string())), pa.field("context_manager", pa.string()),
    pa.field("tool_calls", pa.int32()), pa.field("tool_successes", pa.int32()),
    pa.field("process_reward", pa.float64()), pa.field("retokenized", pa.bool_()), pa.field("round", pa.int64()),
    pa.field("env", pa.string()), pa.field("split", pa.string()), pa.field("status", pa.string()),
    pa.field("won", pa.bool_()), pa.field("episode_return", pa.float64()), pa.field("excluded", pa.bool_()),
    pa.field("shaping", pa.float64()),
])
"""steps.parquet layout 4, as arlflow 4 wrote it (round as int64, text columns nullable)."""


def test_a_layout_4_steps_file_reads_with_an_empty_skill_trace_and_imports(tmp_path: Path) -> None:
    rows = [{"trajectory_id": "t", "group_id": "g", "step_index": k, "prompt_ids": [1, 2], "response_ids": [3],
             "logprobs": [-0.5], "prompt_text": "p", "observation": "o", "action": "a", "response_text": " a",
             "reward": 1.0, "anchor": "", "policy_version": "v", "action_valid": True, "truncated": False,
             "skill_ids": ["walk"], "context_manager": "full", "tool_calls": 0, "tool_successes": 0,
             "process_reward": 0.0, "retokenized": False, "round": 2, "env": "frozenlake", "split": "train",
             "status": "complete", "won": True, "episode_return": 2.0, "excluded": k == 1, "shaping": 0.5}
            for k in range(2)]
    table = pa.Table.from_pandas(pd.DataFrame(rows), schema=V4_STEPS_SCHEMA, preserve_index=False)
    path = tmp_path / "v4.parquet"
    pq.write_table(table.replace_schema_metadata(
        {b"arlflow": json.dumps({"round": 2, "schema_version": 4, "num_rows": 2}).encode()}), path)

    df, metadata = read_steps(path)
    assert metadata["schema_version"] == 4 and list(df.columns) == STEPS_SCHEMA.names
    assert df["plain_prompt_ids"].tolist() == [[], []] and df["macro_action_ids"].tolist() == [[], []]
    assert df["action_choices"].tolist() == [[], []] and df["prefix_break"].tolist() == [False, False]
    assert df["staleness"].tolist() == [0, 0]
    assert df["round"].dtype == "int32" and df["round"].tolist() == [2, 2]  # read as today's type
    export_steps(df, tmp_path / "current.parquet", metadata=metadata)  # re-exports as the current layout, unchanged
    again, meta = read_steps(tmp_path / "current.parquet")
    assert meta["schema_version"] == 8 and again.equals(df)
    with DataPool(str(tmp_path / "pool.db")) as pool:
        assert import_steps(path, pool) == 1
        back = pool.get_trajectory("t")
        assert back.episode_return == 1.5 and back.round == 2  # the env's return: 2.0 - shaping
        assert all(s.plain_prompt_ids == [] and s.macro_prompt_ids == [] for s in back.steps)
        assert {f.name for f in STEP_FIELDS} <= set(vars(back.steps[0]))
        assert pool.curation_of("t")["steps"][1]["excluded"] is True
