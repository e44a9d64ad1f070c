"""The data pool's read side: a trajectory with its steps, trajectories and steps as DataFrames, row counts, and the
Parquet export of a steps frame.

Functions take an open SQLAlchemy ``Connection`` (or, for the export, a frame already read); ``DataPool`` opens the
connection and delegates to them, as it does with ``datapool.curation``.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from datapool import curation
from datapool.parquet import export_steps
from datapool.records import ROW_TRAJECTORY_FIELDS, StepRecord, TrajectoryRecord
from datapool.tables import (ROW_PREFIX, SCHEMA_VERSION, STEP_COLUMNS, STEPS, TRAJECTORIES, TRAJECTORY_COLUMNS,
                             decoded_step, decoded_step_row, decoded_trajectory, decoded_trajectory_row)

__all__ = ["EXCLUDED", "STEP_TRAJECTORY_COLUMNS", "counts", "export_steps_frame", "get_trajectory", "steps_frame",
           "trajectories_frame"]

STEP_TRAJECTORY_COLUMNS: tuple[str, ...] = tuple(f.name for f in ROW_TRAJECTORY_FIELDS)
"""Trajectory fields joined onto every row of ``steps_frame`` (group_id is already a step field); declared by
``on_step_rows`` in datapool.records."""
EXCLUDED = "excluded"
"""The column of ``steps_frame`` that says curation excluded the step or its trajectory (records.ROW_EXTRA_FIELDS)."""

T = TRAJECTORIES
S = STEPS


def get_trajectory(conn: Connection, trajectory_id: str) -> TrajectoryRecord:
    """The trajectory with its steps in order; KeyError if unknown."""
    row = conn.execute(select(T).where(T.c.trajectory_id == trajectory_id)).first()
    if row is None:
        raise KeyError(f"unknown trajectory {trajectory_id!r}")
    steps = conn.execute(select(S).where(S.c.trajectory_id == trajectory_id).order_by(S.c.step_index))
    records = [StepRecord(**decoded_step(step)) for step in steps]
    return decoded_trajectory(row, records)


def trajectories_frame(conn: Connection, *, round: int | None = None, env: str | None = None,
                       split: str | None = None) -> pd.DataFrame:
    """One row per trajectory (all TrajectoryRecord fields but steps), ordered by round, group, id."""
    stmt = select(*(T.c[name] for name in TRAJECTORY_COLUMNS))
    if round is not None:
        stmt = stmt.where(T.c.round == round)
    if env is not None:
        stmt = stmt.where(T.c.env == env)
    if split is not None:
        stmt = stmt.where(T.c.split == split)
    stmt = stmt.order_by(T.c.round, T.c.group_id, T.c.trajectory_id)
    rows = [decoded_trajectory_row(row) for row in conn.execute(stmt)]
    return pd.DataFrame(rows, columns=list(TRAJECTORY_COLUMNS))


def steps_frame(conn: Connection, *, round: int | None = None, env: str | None = None,
                include_excluded: bool = True) -> pd.DataFrame:
    """One row per step, with its trajectory's STEP_TRAJECTORY_COLUMNS joined on and EXCLUDED (the step or its
    trajectory is excluded by curation; ``include_excluded=False`` drops those rows).

    ``prompt_ids``/``response_ids`` are lists of int and ``logprobs`` lists of float (float32 precision).
    Ordered by round, group, trajectory, step index.
    """
    stmt = select(S, *(T.c[name].label(ROW_PREFIX + name) for name in STEP_TRAJECTORY_COLUMNS)).join(
        T, S.c.trajectory_id == T.c.trajectory_id)
    if round is not None:
        stmt = stmt.where(T.c.round == round)
    if env is not None:
        stmt = stmt.where(T.c.env == env)
    stmt = stmt.order_by(T.c.round, S.c.group_id, S.c.trajectory_id, S.c.step_index)
    records = []
    excluded_trajs, excluded_steps = curation.excluded_targets(conn)
    for row in conn.execute(stmt):
        record = decoded_step_row(row)
        record[EXCLUDED] = (row.trajectory_id in excluded_trajs
                            or (row.trajectory_id, row.step_index) in excluded_steps)
        if include_excluded or not record[EXCLUDED]:
            records.append(record)
    return pd.DataFrame(records, columns=[*STEP_COLUMNS, *STEP_TRAJECTORY_COLUMNS, EXCLUDED])


def counts(conn: Connection) -> dict[str, int]:
    """How many trajectories and steps the pool holds."""
    return {"trajectories": conn.scalar(select(func.count()).select_from(T)) or 0,
            "steps": conn.scalar(select(func.count()).select_from(S)) or 0}


def export_steps_frame(df: pd.DataFrame, path: str | Path, *, round: int | None, env: str | None,
                       include_excluded: bool) -> int:
    """Write ``df`` (a ``steps_frame`` read with these filters) to a Parquet file at ``path`` (see
    ``datapool.parquet``); return rows.

    The dataset metadata records the filters, policy versions, envs, trajectory count, excluded and retokenized
    row counts and the pool's schema version."""
    metadata = {
        "round": round,
        "env": env,
        "include_excluded": include_excluded,
        "policy_versions": sorted(set(df["policy_version"])),
        "envs": sorted(set(df["env"])),
        "trajectories": int(df["trajectory_id"].nunique()),
        "excluded_rows": int(df["excluded"].sum()),
        "retokenized_rows": int(df["retokenized"].sum()),
        "pool_schema_version": SCHEMA_VERSION,
    }
    export_steps(df, path, metadata=metadata)
    return len(df)
