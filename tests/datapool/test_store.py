"""DataPool: round trips, idempotency, validation before writing, schema version and migration, SQLite settings.

Tests taking ``pool`` or ``pool_url`` (tests/datapool/conftest.py) run on SQLite and on a real PostgreSQL server."""
from __future__ import annotations

import math
import sqlite3
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

import datapool.store as store
from datapool.parquet import read_steps
from datapool.records import StepRecord, TrajectoryRecord
from datapool.store import SCHEMA_VERSION, DataPool, SchemaVersionError, decode_ids, encode_ids, encode_logprobs


def make_traj(tid: str, group: str = "g0", *, round: int = 1, env: str = "frozenlake", split: str = "train",
              steps: int = 2, episode_return: float = 1.0) -> TrajectoryRecord:
    records = [
        StepRecord(trajectory_id=tid, group_id=group, step_index=k, prompt_ids=[1, 2, 3 + k], response_ids=[7, 8],
                   logprobs=[-0.5, -1.25], prompt_text=f"prompt {k}", observation=f"obs {k}", action="right",
                   response_text=" right", reward=0.25 * k, anchor=f"({k}, 0)", policy_version="v1",
                   skill_ids=["seq-right-down"] if k else [], tool_calls=k, tool_successes=k // 2)
        for k in range(steps)
    ]
    return TrajectoryRecord(trajectory_id=tid, group_id=group, scenario='{"env": "frozenlake", "seed": 3}', env=env,
                            split=split, round=round, policy_version="v1", status="complete",
                            episode_return=episode_return, won=True, num_steps=steps, response_tokens=2 * steps,
                            wall_time_s=0.5, metadata={"seed": 3, "tags": ["a"]}, steps=records)


def test_round_trip_of_trajectories_and_steps(pool: DataPool) -> None:
    assert pool.add_trajectories([make_traj("t0"), make_traj("t1", steps=3)]) == 2
    assert pool.counts() == {"trajectories": 2, "steps": 5}

    trajs = pool.trajectories_frame()
    assert list(trajs["trajectory_id"]) == ["t0", "t1"]
    row = trajs.iloc[1]
    assert row["metadata"] == {"seed": 3, "tags": ["a"]}
    assert row["num_steps"] == 3 and bool(row["won"]) and row["error"] is None

    steps = pool.steps_frame()
    assert list(zip(steps["trajectory_id"], steps["step_index"])) == [("t0", 0), ("t0", 1), ("t1", 0), ("t1", 1),
                                                                       ("t1", 2)]
    first = steps.iloc[2]
    assert first["prompt_ids"] == [1, 2, 3] and all(type(i) is int for i in first["prompt_ids"])
    assert first["response_ids"] == [7, 8]
    assert first["logprobs"] == [-0.5, -1.25]  # exact in float32
    assert steps.iloc[3]["skill_ids"] == ["seq-right-down"]
    assert steps["tool_calls"].tolist() == [0, 1, 0, 1, 2] and steps["tool_successes"].tolist() == [0, 0, 0, 0, 1]
    # joined trajectory columns
    assert {"round", "env", "split", "status", "won", "episode_return", "group_id"} <= set(steps.columns)
    assert set(steps["status"]) == {"complete"}


def test_filters(pool: DataPool) -> None:
    pool.add_trajectories([make_traj("a", round=1), make_traj("b", round=2, env="maze"),
                           make_traj("c", round=2, split="heldout")])
    assert list(pool.trajectories_frame(round=2)["trajectory_id"]) == ["b", "c"]
    assert list(pool.trajectories_frame(env="maze")["trajectory_id"]) == ["b"]
    assert list(pool.trajectories_frame(round=2, split="heldout")["trajectory_id"]) == ["c"]
    assert set(pool.steps_frame(round=2, env="frozenlake")["trajectory_id"]) == {"c"}
    empty = pool.steps_frame(round=9)
    assert len(empty) == 0 and "prompt_ids" in empty.columns and "episode_return" in empty.columns


def test_add_is_idempotent_on_trajectory_id(pool: DataPool) -> None:
    assert pool.add_trajectories([make_traj("t0")]) == 1
    assert pool.add_trajectories([make_traj("t0")]) == 0
    assert pool.add_trajectories([make_traj("t0"), make_traj("t1")]) == 1
    assert pool.add_trajectories([]) == 0
    assert pool.counts() == {"trajectories": 2, "steps": 4}


def _bad(field_path: str):
    """A trajectory broken at ``field_path`` (trajectory field, or 'step.<field>')."""
    traj = make_traj("bad")
    if field_path == "step.logprobs":
        traj.steps[1].logprobs = [-0.5]
    elif field_path == "status":
        traj.status = "exploded"
    elif field_path == "step.reward":
        traj.steps[0].reward = float("nan")
    elif field_path == "step.group_id":
        traj.steps[0].group_id = "other"
    elif field_path == "step.step_index":
        traj.steps[1].step_index = 0
    elif field_path == "step.prompt_ids":
        traj.steps[0].prompt_ids = [1, 2**31]
    elif field_path == "step.response_ids":
        traj.steps[0].response_ids = [1.5, 2.0]
    elif field_path == "metadata":
        traj.metadata = {"x": object()}
    elif field_path == "round":
        traj.round = -1
    elif field_path == "step.tool_calls":
        traj.steps[0].tool_calls = -1
    elif field_path == "step.tool_successes":
        traj.steps[1].tool_successes = 2  # the step made 1 call
    return traj


@pytest.mark.parametrize("field_path", ["step.logprobs", "status", "step.reward", "step.group_id", "step.step_index",
                                        "step.prompt_ids", "step.response_ids", "metadata", "round",
                                        "step.tool_calls", "step.tool_successes"])
def test_invalid_record_names_trajectory_and_field_and_writes_nothing(pool: DataPool, field_path: str) -> None:
    with pytest.raises(ValueError) as err:
        pool.add_trajectories([make_traj("good"), _bad(field_path)])
    message = str(err.value)
    assert "'bad'" in message and f"'{field_path.split('.')[-1]}'" in message
    assert pool.counts() == {"trajectories": 0, "steps": 0}


def test_duplicate_id_in_one_batch_is_rejected(pool: DataPool) -> None:
    with pytest.raises(ValueError, match="twice"):
        pool.add_trajectories([make_traj("t0"), make_traj("t0")])
    assert pool.counts()["trajectories"] == 0


def test_schema_version_is_set_and_a_newer_one_is_refused(pool_url: str, tmp_path: Path) -> None:
    url = pool_url
    with DataPool(url) as pool:
        with pool.engine.begin() as conn:
            assert conn.execute(text("SELECT version FROM schema_version")).scalars().all() == [SCHEMA_VERSION]
            conn.execute(text("UPDATE schema_version SET version = :v"), {"v": SCHEMA_VERSION + 1})
    with pytest.raises(SchemaVersionError, match="upgrade arlflow"):
        DataPool(url)
    with DataPool(str(tmp_path / "fresh" / "other.db")) as fresh:  # a bare path means SQLite; parents are made
        assert fresh.counts() == {"trajectories": 0, "steps": 0}


def test_sqlite_runs_in_wal_mode_with_a_busy_timeout(tmp_path: Path) -> None:
    with DataPool(str(tmp_path / "pool.db")) as pool, pool.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000


def test_concurrent_writers_stay_idempotent(pool_url: str) -> None:
    url = pool_url
    pools = [DataPool(url), DataPool(url)]
    added = [0, 0]

    def write(slot: int) -> None:
        for start in range(0, 20, 4):
            added[slot] += pools[slot].add_trajectories([make_traj(f"t{i:02d}") for i in range(start, start + 6)])

    threads = [threading.Thread(target=write, args=(slot,)) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(added) == 22 and pools[0].counts() == {"trajectories": 22, "steps": 44}
    for p in pools:
        p.close()


def test_export_round_writes_the_round_steps(pool: DataPool, tmp_path: Path) -> None:
    pool.add_trajectories([make_traj("a", round=1), make_traj("b", round=2, steps=3)])
    path = tmp_path / "out" / "round_2.parquet"
    assert pool.export_round(2, path) == 3
    df, metadata = read_steps(path)
    assert metadata["round"] == 2 and metadata["policy_versions"] == ["v1"] and metadata["trajectories"] == 1
    expected = pool.steps_frame(round=2)
    assert list(df.columns) == [*expected.columns, "shaping", "label"]  # the file adds the filters' column (0.0
    # here) and validate's curation label ("" here)
    assert df["shaping"].tolist() == [0.0] * 3 and df["label"].tolist() == [""] * 3 and df["tool_calls"].tolist() == expected["tool_calls"].tolist()
    assert df["prompt_ids"].tolist() == expected["prompt_ids"].tolist()
    assert df["logprobs"].tolist() == expected["logprobs"].tolist()


def test_encoding_is_four_bytes_per_id() -> None:
    blob = encode_ids([0, 1, -1, 2**31 - 1])
    assert len(blob) == 16 and blob[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert decode_ids(blob) == [0, 1, -1, 2**31 - 1]


ids = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12)
f32 = st.floats(-50, 0, width=32)


@st.composite
def trajectories(draw) -> list[TrajectoryRecord]:
    out = []
    for t in range(draw(st.integers(1, 3))):
        tid = f"t{t}"
        steps = []
        for k in range(draw(st.integers(0, 3))):
            response = draw(ids)
            steps.append(StepRecord(
                trajectory_id=tid, group_id="g", step_index=k, prompt_ids=draw(ids), response_ids=response,
                logprobs=draw(st.lists(f32, min_size=len(response), max_size=len(response))),
                prompt_text=draw(st.text(max_size=20)), observation=draw(st.text(max_size=20)),
                action=draw(st.text(max_size=5)), response_text=draw(st.text(max_size=5)),
                reward=draw(st.floats(allow_nan=False)), anchor=draw(st.text(max_size=8)), policy_version="v0",
                action_valid=draw(st.booleans()), truncated=draw(st.booleans()),
                skill_ids=draw(st.lists(st.text(max_size=6), max_size=2)), tool_calls=draw(st.integers(0, 4)),
                tool_successes=0, retokenized=draw(st.booleans())))
            steps[-1].tool_successes = draw(st.integers(0, steps[-1].tool_calls))
        out.append(TrajectoryRecord(
            trajectory_id=tid, group_id="g", scenario="{}", env="e", split="train", round=draw(st.integers(0, 5)),
            policy_version="v0", status=draw(st.sampled_from(["complete", "truncated", "failed"])),
            episode_return=draw(st.floats(allow_nan=False)), won=draw(st.booleans()), num_steps=len(steps),
            response_tokens=0, metadata={"k": draw(st.text(max_size=5))}, steps=steps))
    return out


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories())
def test_store_round_trips_any_valid_records(trajs: list[TrajectoryRecord]) -> None:
    with tempfile.TemporaryDirectory() as tmp, DataPool(f"{tmp}/pool.db") as pool:
        assert pool.add_trajectories(trajs) == len(trajs)
        steps = pool.steps_frame()
        expected = [s for t in trajs for s in t.steps]
        assert len(steps) == len(expected)
        by_key = {(r.trajectory_id, r.step_index): r for r in steps.itertuples()}
        for step in expected:
            row = by_key[(step.trajectory_id, step.step_index)]
            assert row.prompt_ids == step.prompt_ids and row.response_ids == step.response_ids
            assert row.logprobs == [float(np.float32(x)) for x in step.logprobs]
            assert row.observation == step.observation and row.skill_ids == step.skill_ids
            assert (row.tool_calls, row.tool_successes) == (step.tool_calls, step.tool_successes)
            assert row.retokenized == step.retokenized and row.excluded is False
            assert row.reward == step.reward or (math.isinf(row.reward) and row.reward == step.reward)
        frame = pool.trajectories_frame()
        assert sorted(frame["trajectory_id"]) == sorted(t.trajectory_id for t in trajs)


# The version-1 tables exactly as arlflow created them in SQLite before tool counts existed.
V1_SCHEMA = """
CREATE TABLE schema_version (id INTEGER NOT NULL, version INTEGER NOT NULL, PRIMARY KEY (id));
CREATE TABLE trajectories (
    trajectory_id TEXT NOT NULL, group_id TEXT NOT NULL, scenario TEXT NOT NULL, env TEXT NOT NULL,
    split TEXT NOT NULL, round INTEGER NOT NULL, policy_version TEXT NOT NULL, status TEXT NOT NULL,
    episode_return FLOAT NOT NULL, won BOOLEAN NOT NULL, num_steps INTEGER NOT NULL,
    response_tokens INTEGER NOT NULL, wall_time_s FLOAT NOT NULL, error TEXT, metadata JSON NOT NULL,
    PRIMARY KEY (trajectory_id));
CREATE INDEX ix_trajectories_group_id ON trajectories (group_id);
CREATE INDEX ix_trajectories_env ON trajectories (env);
CREATE INDEX ix_trajectories_round ON trajectories (round);
CREATE TABLE steps (
    id INTEGER NOT NULL, trajectory_id TEXT NOT NULL, group_id TEXT NOT NULL, step_index INTEGER NOT NULL,
    prompt_ids BLOB NOT NULL, response_ids BLOB NOT NULL, logprobs BLOB NOT NULL, prompt_text TEXT NOT NULL,
    observation TEXT NOT NULL, action TEXT NOT NULL, response_text TEXT NOT NULL, reward FLOAT NOT NULL,
    anchor TEXT NOT NULL, policy_version TEXT NOT NULL, action_valid BOOLEAN NOT NULL, truncated BOOLEAN NOT NULL,
    skill_ids JSON NOT NULL, context_manager TEXT NOT NULL,
    PRIMARY KEY (id), CONSTRAINT uq_steps_trajectory_step UNIQUE (trajectory_id, step_index),
    FOREIGN KEY(trajectory_id) REFERENCES trajectories (trajectory_id));
INSERT INTO schema_version VALUES (1, 1);
INSERT INTO trajectories VALUES ('old', 'g0', '{}', 'frozenlake', 'train', 1, 'v0', 'complete', 1.0, 1, 1, 2, 0.5,
    NULL, '{"seed": 3}');
"""


def test_a_version_1_pool_is_migrated_in_place(tmp_path: Path) -> None:
    db = tmp_path / "v1.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(V1_SCHEMA)
        conn.execute("INSERT INTO steps (trajectory_id, group_id, step_index, prompt_ids, response_ids, logprobs, "
                     "prompt_text, observation, action, response_text, reward, anchor, policy_version, action_valid, "
                     "truncated, skill_ids, context_manager) VALUES ('old', 'g0', 0, ?, ?, ?, 'p', 'o', 'up', ' up', "
                     "1.0, 'a', 'v0', 1, 0, '[]', 'full')",
                     (encode_ids([1, 2]), encode_ids([3, 4]), encode_logprobs([-0.5, -0.25])))
    conn.close()

    assert SCHEMA_VERSION == 8
    # 1 -> 2 (tool counts) -> 3 (process reward) -> 4 (gateway) -> 5 (skill trace) -> 6 (action choices) -> 7 (prefix_break)
    with DataPool(str(db)) as pool:
        with pool.engine.connect() as conn:
            assert conn.execute(text("SELECT id, version FROM schema_version")).all() == [(1, 8)]
        old = pool.steps_frame()
        assert old["trajectory_id"].tolist() == ["old"] and old["response_ids"].tolist() == [[3, 4]]
        assert old["tool_calls"].tolist() == [0] and old["tool_successes"].tolist() == [0]
        assert old["process_reward"].tolist() == [0.0]
        assert old["retokenized"].tolist() == [False] and old["excluded"].tolist() == [False]
        assert old["plain_prompt_ids"].tolist() == [[]] and old["macro_prompt_ids"].tolist() == [[]]
        assert pool.query_trajectories()[0]["created_at"] == 0.0  # unknown for rows older than version 4
        assert pool.add_trajectories([make_traj("new", steps=3)]) == 1
        assert pool.steps_frame()["tool_calls"].tolist() == [0, 1, 2, 0]  # "new" sorts before "old"
    with DataPool(str(db)) as again:  # opening a migrated pool is a no-op
        assert again.counts() == {"trajectories": 2, "steps": 4}
    with DataPool(str(tmp_path / "fresh.db")):
        pass
    migrated, fresh = _table_info(db), _table_info(tmp_path / "fresh.db")
    assert migrated["steps"]["tool_calls"] == ("INTEGER", 1, "0")  # (type, not null, default)
    assert migrated["steps"]["plain_prompt_ids"] == ("BLOB", 1, "X''")
    for table in ("trajectories", "steps"):  # the columns of a pool created today; those added, with its types
        assert list(migrated[table]) == list(fresh[table]), table
        original = _table_info_of_script(V1_SCHEMA)[table]
        assert {name: info[:2] for name, info in migrated[table].items() if name not in original} == \
            {name: info[:2] for name, info in fresh[table].items() if name not in original}, table


def _table_info(db: Path | str, script: str = "") -> dict[str, dict[str, tuple]]:
    """table -> column -> (declared type, not null, default SQL) of a SQLite file (after running ``script``)."""
    with sqlite3.connect(db) as conn:
        conn.executescript(script)
        out = {table: {row[1]: (row[2], row[3], row[4]) for row in conn.execute(f"PRAGMA table_info({table})")}
               for table in ("trajectories", "steps")}
    conn.close()
    return out


def _table_info_of_script(script: str) -> dict[str, dict[str, tuple]]:
    return _table_info(":memory:", script)


def test_a_failed_migration_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "v1.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(V1_SCHEMA)
    conn.close()

    def half_then_crash(conn) -> None:
        conn.execute(text("ALTER TABLE steps ADD COLUMN tool_calls INTEGER NOT NULL DEFAULT 0"))
        raise RuntimeError("disk full")

    monkeypatch.setitem(store.MIGRATIONS, 1, half_then_crash)
    with pytest.raises(RuntimeError, match="disk full"):
        DataPool(str(db))
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(1,)]
        assert "tool_calls" not in {row[1] for row in conn.execute("PRAGMA table_info(steps)")}
    conn.close()
    monkeypatch.undo()
    with DataPool(str(db)) as pool:  # the real migration still works afterwards
        assert pool.add_trajectories([make_traj("new")]) == 1
        assert pool.steps_frame()["tool_calls"].tolist() == [0, 1]


def test_opening_a_rollback_journal_pool_waits_while_another_connection_holds_its_write_lock(tmp_path: Path) -> None:
    # switching a rollback-journal file to WAL while another connection holds its write lock fails at once in
    # SQLite ("database is locked", no busy handler): the race behind three openers migrating one old pool
    db = tmp_path / "v1.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(V1_SCHEMA)
    conn.close()
    held, release = threading.Event(), threading.Event()

    def hold_write_lock() -> None:
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        held.set()
        release.wait(10)
        other.execute("COMMIT")
        other.close()

    holder = threading.Thread(target=hold_write_lock)
    holder.start()
    held.wait(10)
    threading.Timer(0.4, release.set).start()
    try:
        pool = DataPool(str(db))
    finally:
        release.set()
        holder.join()
    pool.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    conn.close()


def test_two_processes_opening_a_version_1_pool_at_once_migrate_it_once(tmp_path: Path) -> None:
    db = tmp_path / "v1.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(V1_SCHEMA)
    conn.close()
    errors: list[BaseException] = []

    def open_pool() -> None:
        try:
            DataPool(str(db)).close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_pool) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    conn.close()
