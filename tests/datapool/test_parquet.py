"""Parquet export of the step table: explicit schema, metadata, atomic writes, clear errors, older layouts read."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import datapool.parquet as parquet
from datapool.parquet import ADDED_COLUMNS, STEPS_SCHEMA, STEPS_SCHEMA_VERSION, StepsFileError, export_steps, read_steps


def step_row(tid: str = "t0", k: int = 0, *, prompt_ids=(1, 2, 3), response_ids=(4, 5), logprobs=(-0.5, -0.25),
             reward: float = 1.0) -> dict:
    return {
        "trajectory_id": tid, "group_id": "g0", "step_index": k, "prompt_ids": list(prompt_ids),
        "response_ids": list(response_ids), "logprobs": list(logprobs), "prompt_text": "p", "observation": "o",
        "action": "right", "response_text": " right", "reward": reward, "anchor": "(0, 0)", "policy_version": "v1",
        "action_valid": True, "truncated": False, "skill_ids": ["seq-a-b"], "context_manager": "full", "round": 2,
        "env": "frozenlake", "split": "train", "status": "complete", "won": True, "episode_return": 1.0,
        "tool_calls": 2, "tool_successes": 1, "shaping": -0.25, "retokenized": False, "excluded": False,
    }


def frame(n: int = 3) -> pd.DataFrame:
    return pd.DataFrame([step_row(f"t{i}", i) for i in range(n)], columns=STEPS_SCHEMA.names)


def test_round_trip_with_schema_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "round_2.parquet"
    assert export_steps(frame(), path, metadata={"round": 2, "policy_version": "v1"}) == path
    df, metadata = read_steps(path)
    assert metadata == {"round": 2, "policy_version": "v1", "schema_version": 8, "num_rows": 3}
    assert df["prompt_ids"].tolist() == [[1, 2, 3]] * 3 and df["skill_ids"].tolist() == [["seq-a-b"]] * 3
    assert df["logprobs"].tolist() == [[-0.5, -0.25]] * 3
    assert df["tool_calls"].tolist() == [2] * 3 and df["tool_successes"].tolist() == [1] * 3
    assert df["shaping"].tolist() == [-0.25] * 3
    assert list(df.columns) == STEPS_SCHEMA.names

    schema = pq.read_schema(path)
    assert schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert schema.field("response_ids").type == pa.list_(pa.int32())
    assert schema.field("logprobs").type == pa.list_(pa.float32())
    assert json.loads(schema.metadata[b"arlflow"])["round"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["round_2.parquet"]  # no temporary file left


def test_empty_frame_round_trips(tmp_path: Path) -> None:
    export_steps(frame(0), tmp_path / "empty.parquet", metadata={"round": 5})
    df, metadata = read_steps(tmp_path / "empty.parquet")
    assert len(df) == 0 and metadata["num_rows"] == 0 and list(df.columns) == STEPS_SCHEMA.names


def test_crash_while_writing_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "steps.parquet"
    export_steps(frame(2), path, metadata={"round": 1})

    def crash(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(parquet.pq, "write_table", crash)
    with pytest.raises(OSError, match="disk full"):
        export_steps(frame(5), path, metadata={"round": 2})
    df, metadata = read_steps(path)
    assert len(df) == 2 and metadata["round"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["steps.parquet"]


def test_missing_corrupt_and_foreign_files_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(StepsFileError, match="nope.parquet missing"):
        read_steps(tmp_path / "nope.parquet")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"this is not parquet at all")
    with pytest.raises(StepsFileError, match="corrupt.parquet is corrupt"):
        read_steps(corrupt)
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"x": [1]}), foreign)
    with pytest.raises(StepsFileError, match="foreign.parquet has no 'arlflow' metadata"):
        read_steps(foreign)


def test_newer_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.parquet"
    export_steps(frame(1), path, metadata={})
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({b"arlflow": json.dumps({"schema_version": 99}).encode()}), path)
    with pytest.raises(StepsFileError, match="upgrade arlflow"):
        read_steps(path)


def test_bad_frames_are_rejected_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "x.parquet"
    with pytest.raises(ValueError, match=r"missing columns \['logprobs'\]"):
        export_steps(frame().drop(columns=["logprobs"]), path, metadata={})
    with pytest.raises(ValueError, match=r"unknown columns \['advantage'\]"):
        export_steps(frame().assign(advantage=0.0), path, metadata={})
    too_big = pd.DataFrame([step_row(prompt_ids=[2**31])], columns=STEPS_SCHEMA.names)
    with pytest.raises(ValueError, match="does not fit STEPS_SCHEMA"):
        export_steps(too_big, path, metadata={})
    with pytest.raises(ValueError, match="JSON"):
        export_steps(frame(), path, metadata={"bad": object()})
    assert not path.exists() and list(tmp_path.iterdir()) == []


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6),
                          st.lists(st.floats(-30, 0, width=32), max_size=6),
                          st.floats(allow_nan=False)), max_size=5))
def test_any_step_table_round_trips(rows) -> None:
    df = pd.DataFrame([step_row(f"t{i}", i, prompt_ids=ids, response_ids=ids[: len(lp)], logprobs=lp, reward=r)
                       for i, (ids, lp, r) in enumerate(rows)], columns=STEPS_SCHEMA.names)
    with tempfile.TemporaryDirectory() as tmp:
        export_steps(df, Path(tmp) / "s.parquet", metadata={"round": 0})
        back, _ = read_steps(Path(tmp) / "s.parquet")
    assert back["prompt_ids"].tolist() == df["prompt_ids"].tolist()
    assert back["logprobs"].tolist() == [[float(np.float32(x)) for x in lp] for lp in df["logprobs"]]
    assert back["reward"].tolist() == df["reward"].tolist()


V1_NAMES = [name for name in STEPS_SCHEMA.names if name not in ADDED_COLUMNS]


def test_a_version_1_file_reads_with_the_added_columns_filled(tmp_path: Path) -> None:
    """A file written before tool counts, shaping, process rewards and the retokenized/excluded flags existed
    (layout 1, by hand) reads with 0 / 0 / 0.0 / 0.0 / False / False."""
    assert STEPS_SCHEMA_VERSION == 8
    v1_schema = pa.schema([STEPS_SCHEMA.field(name) for name in V1_NAMES])
    table = pa.Table.from_pandas(frame(2)[V1_NAMES], schema=v1_schema, preserve_index=False)
    path = tmp_path / "old.parquet"
    pq.write_table(table.replace_schema_metadata(
        {b"arlflow": json.dumps({"round": 1, "schema_version": 1, "num_rows": 2}).encode()}), path)

    df, metadata = read_steps(path)
    assert metadata["schema_version"] == 1
    assert list(df.columns) == STEPS_SCHEMA.names
    assert df["tool_calls"].tolist() == [0, 0] and df["tool_successes"].tolist() == [0, 0]
    assert df["shaping"].tolist() == [0.0, 0.0] and df["process_reward"].tolist() == [0.0, 0.0]
    assert df["retokenized"].tolist() == [False, False] and df["excluded"].tolist() == [False, False]
    assert df["prompt_ids"].tolist() == [[1, 2, 3]] * 2
    # and it re-exports as the current layout unchanged
    export_steps(df, tmp_path / "new.parquet", metadata=metadata)
    again, meta2 = read_steps(tmp_path / "new.parquet")
    assert meta2["schema_version"] == 8 and again.equals(df)


def test_a_frame_without_the_added_columns_exports_with_defaults(tmp_path: Path) -> None:
    """A pool frame has no ``shaping`` (and older callers no tool counts): export fills them, the input untouched."""
    pool_like = frame(2).drop(columns=list(ADDED_COLUMNS))
    before = pool_like.copy()
    export_steps(pool_like, tmp_path / "s.parquet", metadata={})
    pd.testing.assert_frame_equal(pool_like, before)
    df, _ = read_steps(tmp_path / "s.parquet")
    assert df["tool_calls"].tolist() == [0, 0] and df["shaping"].tolist() == [0.0, 0.0]
    assert pq.read_schema(tmp_path / "s.parquet").field("tool_calls").type == pa.int32()
