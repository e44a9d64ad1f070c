"""The data pool's read side: a trajectory with its steps, trajectories and steps as DataFrames, row counts, the
per-round and per-group summaries the UI draws, and the Parquet export of a steps frame.

Functions take an open SQLAlchemy ``Connection`` (or, for the export, a frame already read); ``DataPool`` opens the
connection and delegates to them, as it does with ``datapool.curation``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import case, func, select
from sqlalchemy.engine import Connection

from datapool import curation
from datapool.parquet import export_steps
from datapool.records import ROW_TRAJECTORY_FIELDS, StepRecord, TrajectoryRecord
from datapool.tables import (ROW_PREFIX, SCHEMA_VERSION, STEP_COLUMNS, STEPS, TRAJECTORIES, TRAJECTORY_COLUMNS,
                             decoded_step, decoded_step_row, decoded_trajectory, decoded_trajectory_row)

__all__ = ["EXCLUDED", "STEP_TRAJECTORY_COLUMNS", "counts", "export_steps_frame", "get_trajectory", "group_returns",
           "round_summaries", "steps_frame", "trajectories_frame"]

STEP_TRAJECTORY_COLUMNS: tuple[str, ...] = tuple(f.name for f in ROW_TRAJECTORY_FIELDS)
"""Trajectory fields joined onto every row of ``steps_frame`` (group_id is already a step field); declared by
``on_step_rows`` in datapool.records."""
EXCLUDED = "excluded"
"""The column of ``steps_frame`` that says curation excluded the step or its trajectory (records.ROW_EXTRA_FIELDS)."""

ID_BYTES = 4
"""Bytes per stored token id (``tables.encode_ids``: int32): a step's token count is its blob's length / ID_BYTES."""

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


def _count_where(condition: Any) -> Any:
    """How many rows meet ``condition`` (0, not NULL, when none do)."""
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def _token_summaries(conn: Connection, ids_column: Any, where: list[Any]) -> dict[int, dict[str, float | int]]:
    """round -> {"mean", "p95"} of the tokens per step in ``ids_column`` (of the trajectories ``where`` selects).
    SQL groups the steps by round and blob length, so what comes back is bounded by rounds x distinct lengths, never
    by steps. p95 is the nearest rank: the smallest length at least 95% of the round's steps do not exceed."""
    length = func.length(ids_column)
    stmt = (select(T.c.round, length.label("bytes"), func.count().label("steps"))
            .select_from(S.join(T, S.c.trajectory_id == T.c.trajectory_id)).where(*where)
            .group_by(T.c.round, length).order_by(T.c.round, length))
    frame = pd.DataFrame(conn.execute(stmt).all(), columns=["round", "bytes", "steps"])
    out = {}
    for round_index, part in frame.groupby("round", sort=True):
        tokens, steps = part["bytes"].to_numpy() // ID_BYTES, part["steps"].to_numpy()
        rank = -(-95 * int(steps.sum()) // 100)  # ceil(0.95 n) in integers
        out[int(round_index)] = {"mean": float((tokens * steps).sum() / steps.sum()),
                                 "p95": int(tokens[np.searchsorted(steps.cumsum(), rank)])}
    return out


def round_summaries(conn: Connection, *, env: str | None = None) -> list[dict[str, Any]]:
    """One summary per round (of ``env``'s trajectories when given), in round order: trajectories, mean return,
    success rate (won), the shares of episodes that ended truncated (the env's step limit) or failed; steps, and
    per step the invalid-action rate and the share of responses truncated at max_new_tokens; prompt and response
    tokens per step (mean, p95). Every trajectory the pool holds counts, curated or not.

    Aggregated in SQL (token counts from the stored blobs' lengths), so a big pool costs scans, not decoding."""
    where = [T.c.env == env] if env is not None else []
    trajectories = conn.execute(
        select(T.c.round, func.count().label("trajectories"), func.avg(T.c.episode_return).label("mean_return"),
               _count_where(T.c.won.is_(True)).label("won"), _count_where(T.c.status == "truncated").label("truncated"),
               _count_where(T.c.status == "failed").label("failed"))
        .where(*where).group_by(T.c.round).order_by(T.c.round)).all()
    steps = {row.round: row for row in conn.execute(
        select(T.c.round, func.count().label("steps"),
               _count_where(curation.STEP_FLAGS["invalid_action"]).label("invalid"),
               _count_where(curation.STEP_FLAGS["truncated"]).label("truncated"))
        .select_from(S.join(T, S.c.trajectory_id == T.c.trajectory_id)).where(*where).group_by(T.c.round))}
    prompt_tokens = _token_summaries(conn, S.c.prompt_ids, where)
    response_tokens = _token_summaries(conn, S.c.response_ids, where)
    out = []
    for row in trajectories:
        n, step_row = row.trajectories, steps.get(row.round)
        n_steps = step_row.steps if step_row is not None else 0
        out.append({
            "round": row.round, "trajectories": n, "mean_return": row.mean_return, "success_rate": row.won / n,
            "truncated_episode_rate": row.truncated / n, "failed_episode_rate": row.failed / n, "steps": n_steps,
            "invalid_action_rate": step_row.invalid / n_steps if n_steps else None,
            "truncated_response_rate": step_row.truncated / n_steps if n_steps else None,
            "prompt_tokens": prompt_tokens.get(row.round), "response_tokens": response_tokens.get(row.round)})
    return out


def group_returns(conn: Connection, round: int, *, env: str | None = None,
                  limit: int = 500) -> tuple[list[dict[str, Any]], int]:
    """The reward distribution of each group of ``round`` (the first ``limit`` by group id) and how many groups the
    round has: per group its env, trajectories, wins, min/mean/max return and the returns themselves, sorted."""
    where = [T.c.round == round, *([T.c.env == env] if env is not None else [])]
    total = conn.scalar(select(func.count(func.distinct(T.c.group_id))).where(*where)) or 0
    first = select(T.c.group_id).where(*where).distinct().order_by(T.c.group_id).limit(limit).scalar_subquery()
    rows = conn.execute(select(T.c.group_id, T.c.env, T.c.episode_return, T.c.won)
                        .where(*where, T.c.group_id.in_(first)).order_by(T.c.group_id, T.c.episode_return)).all()
    frame = pd.DataFrame(rows, columns=["group_id", "env", "episode_return", "won"])
    groups = [{"group_id": group_id, "env": part["env"].iloc[0], "trajectories": len(part),
               "won": int(part["won"].sum()), "min_return": float(part["episode_return"].min()),
               "mean_return": float(part["episode_return"].mean()),
               "max_return": float(part["episode_return"].max()), "returns": part["episode_return"].tolist()}
              for group_id, part in frame.groupby("group_id", sort=True)]
    return groups, total


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
