"""Curation and queries over the data pool: label or exclude trajectories and steps (kept, never deleted), find
trajectories by env/round/policy/reward/status/label/flag, and count what the pool holds.

Functions take an open SQLAlchemy ``Connection``; ``DataPool`` wraps them in its transactions (``curate`` runs with
the trajectory's row locked, so its upsert cannot race another curation of the same target).
"""
from __future__ import annotations

import time
from typing import Any

import pandas as pd
from sqlalchemy import and_, case, exists, func, insert, select, update
from sqlalchemy.engine import Connection

from datapool.records import TRAJECTORY_STATUSES, is_int, is_real
from datapool.tables import STEPS, TRAJECTORIES, TRAJECTORY_COLUMNS, CurationRow

T = TRAJECTORIES
S = STEPS
C = CurationRow.__table__

STEP_FLAGS = {
    "truncated": S.c.truncated.is_(True),
    "invalid_action": S.c.action_valid.is_(False),
    "retokenized": S.c.retokenized.is_(True),
    "tool_failure": S.c.tool_successes < S.c.tool_calls,
    "prefix_break": S.c.prefix_break.is_(True),
}
"""flag name -> the condition on a step; a trajectory has the flag when at least one of its steps meets it."""

MAX_LIMIT = 10_000


def _target(trajectory_id: str, step_index: int | None):
    where = C.c.trajectory_id == trajectory_id
    return and_(where, C.c.step_index.is_(None) if step_index is None else C.c.step_index == step_index)


def curate(conn: Connection, trajectory_id: str, *, step_index: int | None = None, excluded: bool | None = None,
           label: str | None = None, note: str = "") -> None:
    """Upsert the curation row of trajectory ``trajectory_id`` (``step_index`` None) or of one of its steps.

    ``excluded``/``label`` None keep the stored value (a new row: not excluded, no label); ``label=""`` clears the
    label; a non-empty ``note`` replaces the note. KeyError for an unknown trajectory or step. The caller holds
    the trajectory's row lock (``DataPool.curate``).
    """
    if step_index is not None and (not is_int(step_index) or step_index < 0):
        raise ValueError(f"field 'step_index' must be an int >= 0 or None, got {step_index!r}")
    if excluded is not None and not isinstance(excluded, bool):
        raise ValueError(f"field 'excluded' must be a bool or None, got {excluded!r}")
    if label is not None and not isinstance(label, str):
        raise ValueError(f"field 'label' must be a str or None, got {label!r}")
    if not isinstance(note, str):
        raise ValueError(f"field 'note' must be a str, got {note!r}")
    if conn.scalar(select(T.c.trajectory_id).where(T.c.trajectory_id == trajectory_id)) is None:
        raise KeyError(f"unknown trajectory {trajectory_id!r}")
    if step_index is not None and conn.scalar(select(S.c.id).where(
            S.c.trajectory_id == trajectory_id, S.c.step_index == step_index)) is None:
        raise KeyError(f"unknown step {step_index} of trajectory {trajectory_id!r}")
    now = time.time()
    row = conn.execute(select(C.c.id).where(_target(trajectory_id, step_index))).first()
    if row is None:
        conn.execute(insert(C), {
            "kind": "trajectory" if step_index is None else "step", "trajectory_id": trajectory_id,
            "step_index": step_index, "excluded": bool(excluded), "label": label or None, "note": note,
            "updated_at": now})
        return
    values: dict[str, Any] = {"updated_at": now}
    if excluded is not None:
        values["excluded"] = excluded
    if label is not None:
        values["label"] = label or None
    if note:
        values["note"] = note
    conn.execute(update(C).where(C.c.id == row.id).values(**values))


def _curation_dict(row: Any) -> dict[str, Any]:
    return {"excluded": bool(row.excluded), "label": row.label, "note": row.note, "updated_at": row.updated_at}


def curation_of(conn: Connection, trajectory_id: str) -> dict[str, Any]:
    """{"trajectory": {excluded, label, note, updated_at} | None, "steps": {step_index: {...}}}; KeyError for an
    unknown trajectory."""
    if conn.scalar(select(T.c.trajectory_id).where(T.c.trajectory_id == trajectory_id)) is None:
        raise KeyError(f"unknown trajectory {trajectory_id!r}")
    out: dict[str, Any] = {"trajectory": None, "steps": {}}
    for row in conn.execute(select(C).where(C.c.trajectory_id == trajectory_id).order_by(C.c.step_index)):
        if row.step_index is None:
            out["trajectory"] = _curation_dict(row)
        else:
            out["steps"][row.step_index] = _curation_dict(row)
    return out


def excluded_targets(conn: Connection) -> tuple[set[str], set[tuple[str, int]]]:
    """(ids of excluded trajectories, (trajectory_id, step_index) of excluded steps)."""
    trajs: set[str] = set()
    steps: set[tuple[str, int]] = set()
    for row in conn.execute(select(C.c.trajectory_id, C.c.step_index).where(C.c.excluded.is_(True))):
        if row.step_index is None:
            trajs.add(row.trajectory_id)
        else:
            steps.add((row.trajectory_id, row.step_index))
    return trajs, steps


CURATION_FRAME_COLUMNS = ("trajectory_id", "step_index", "excluded", "label", "note")
"""One row per curated target; step_index -1 is the trajectory itself."""


def curation_rows(conn: Connection, *, round: int | None = None) -> list[dict[str, Any]]:
    """Every curation row (of trajectories of ``round``, when given) as CURATION_FRAME_COLUMNS, sorted by
    (trajectory_id, step_index): the same curation always gives the same rows (no timestamps)."""
    query = select(C.c.trajectory_id, C.c.step_index, C.c.excluded, C.c.label, C.c.note)
    if round is not None:
        query = query.join(T, T.c.trajectory_id == C.c.trajectory_id).where(T.c.round == round)
    rows = [{"trajectory_id": r.trajectory_id, "step_index": -1 if r.step_index is None else int(r.step_index),
             "excluded": bool(r.excluded), "label": r.label or "", "note": r.note or ""}
            for r in conn.execute(query)]
    return sorted(rows, key=lambda r: (r["trajectory_id"], r["step_index"]))


def _check_query(status: str | None, flag: str | None, min_return: Any, max_return: Any, round: Any,
                 excluded: Any, limit: Any, offset: Any) -> None:
    if status is not None and status not in TRAJECTORY_STATUSES:
        raise ValueError(f"field 'status' is {status!r}; valid statuses: {', '.join(TRAJECTORY_STATUSES)}")
    if flag is not None and flag not in STEP_FLAGS:
        raise ValueError(f"field 'flag' is {flag!r}; valid flags: {', '.join(STEP_FLAGS)}")
    for name, value in (("min_return", min_return), ("max_return", max_return)):
        if value is not None and not is_real(value):
            raise ValueError(f"field {name!r} must be a real number or None, got {value!r}")
    if round is not None and not is_int(round):
        raise ValueError(f"field 'round' must be an int or None, got {round!r}")
    if excluded is not None and not isinstance(excluded, bool):
        raise ValueError(f"field 'excluded' must be a bool or None, got {excluded!r}")
    if not is_int(limit) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"field 'limit' must be an int in [1, {MAX_LIMIT}], got {limit!r}")
    if not is_int(offset) or offset < 0:
        raise ValueError(f"field 'offset' must be an int >= 0, got {offset!r}")


def query_trajectories(conn: Connection, *, env: str | None = None, round: int | None = None,
                       policy_version: str | None = None, status: str | None = None,
                       min_return: float | None = None, max_return: float | None = None, label: str | None = None,
                       excluded: bool | None = None, flag: str | None = None, limit: int = 100,
                       offset: int = 0) -> list[dict[str, Any]]:
    """Trajectories matching every given filter, newest first (then by id, descending).

    Each dict holds the TRAJECTORY_COLUMNS plus ``created_at`` (epoch seconds), ``excluded`` (the trajectory
    itself is excluded), ``excluded_steps`` (how many of its steps are), ``labels`` (sorted labels of the
    trajectory and its steps) and ``flags`` (the STEP_FLAGS at least one of its steps has). ``label`` matches a
    label on the trajectory or any of its steps; ``flag`` keeps trajectories with >= 1 such step.
    """
    _check_query(status, flag, min_return, max_return, round, excluded, limit, offset)
    trajectory_excluded = exists().where(C.c.trajectory_id == T.c.trajectory_id, C.c.step_index.is_(None),
                                         C.c.excluded.is_(True))
    stmt = select(*(T.c[name] for name in TRAJECTORY_COLUMNS), T.c.created_at,
                  trajectory_excluded.label("excluded"))
    for column, value in ((T.c.env, env), (T.c.round, round), (T.c.policy_version, policy_version),
                          (T.c.status, status)):
        if value is not None:
            stmt = stmt.where(column == value)
    if min_return is not None:
        stmt = stmt.where(T.c.episode_return >= min_return)
    if max_return is not None:
        stmt = stmt.where(T.c.episode_return <= max_return)
    if label is not None:
        stmt = stmt.where(exists().where(C.c.trajectory_id == T.c.trajectory_id, C.c.label == label))
    if excluded is not None:
        stmt = stmt.where(trajectory_excluded if excluded else ~trajectory_excluded)
    if flag is not None:
        stmt = stmt.where(exists().where(S.c.trajectory_id == T.c.trajectory_id, STEP_FLAGS[flag]))
    stmt = stmt.order_by(T.c.created_at.desc(), T.c.trajectory_id.desc()).limit(limit).offset(offset)
    rows = [dict(row._mapping) for row in conn.execute(stmt)]
    if not rows:
        return []
    ids = [row["trajectory_id"] for row in rows]
    labels: dict[str, set[str]] = {tid: set() for tid in ids}
    excluded_steps: dict[str, int] = dict.fromkeys(ids, 0)
    for row in conn.execute(select(C.c.trajectory_id, C.c.step_index, C.c.label, C.c.excluded)
                            .where(C.c.trajectory_id.in_(ids))):
        if row.label:
            labels[row.trajectory_id].add(row.label)
        if row.step_index is not None and row.excluded:
            excluded_steps[row.trajectory_id] += 1
    flag_sums = [func.sum(case((condition, 1), else_=0)).label(name) for name, condition in STEP_FLAGS.items()]
    flags: dict[str, list[str]] = {tid: [] for tid in ids}
    for row in conn.execute(select(S.c.trajectory_id, *flag_sums).where(S.c.trajectory_id.in_(ids))
                            .group_by(S.c.trajectory_id)):
        flags[row.trajectory_id] = [name for name in STEP_FLAGS if row._mapping[name]]
    for row in rows:
        tid = row["trajectory_id"]
        row["won"], row["excluded"] = bool(row["won"]), bool(row["excluded"])
        row.update(labels=sorted(labels[tid]), excluded_steps=excluded_steps[tid], flags=flags[tid])
    return rows


def _count_by(conn: Connection, column) -> dict[Any, int]:
    return {key: count for key, count in conn.execute(
        select(column, func.count()).group_by(column).order_by(column))}


def stats(conn: Connection) -> dict[str, Any]:
    """What the pool holds: trajectories (total and by status, env, round), steps, excluded trajectories and
    steps, labels (label -> rows), retokenized steps and flagged steps per STEP_FLAGS."""
    flag_sums = [func.coalesce(func.sum(case((condition, 1), else_=0)), 0).label(name)
                 for name, condition in STEP_FLAGS.items()]
    step_row = conn.execute(select(func.count(), *flag_sums).select_from(S)).one()
    excluded_trajs, excluded_steps = excluded_targets(conn)
    labels = {label: count for label, count in conn.execute(
        select(C.c.label, func.count()).where(C.c.label.isnot(None)).group_by(C.c.label).order_by(C.c.label))}
    return {
        "trajectories": conn.scalar(select(func.count()).select_from(T)) or 0,
        "by_status": _count_by(conn, T.c.status),
        "by_env": _count_by(conn, T.c.env),
        "by_round": _count_by(conn, T.c.round),
        "steps": step_row[0],
        "excluded_trajectories": len(excluded_trajs),
        "excluded_steps": len(excluded_steps),
        "labels": labels,
        "retokenized_steps": int(step_row._mapping["retokenized"]),
        "flagged_steps": {name: int(step_row._mapping[name]) for name in STEP_FLAGS},
    }


__all__ = ["STEP_FLAGS", "TRAJECTORY_COLUMNS", "curate", "curation_of", "excluded_targets", "query_trajectories",
           "stats"]


def apply_curation(frame: pd.DataFrame, curation: pd.DataFrame | None) -> tuple[pd.DataFrame, dict[str, int]]:
    """``frame`` (a step table) with the pool's curation applied: excluded trajectories and steps dropped, the
    ``label`` column set (a step's own label, else its trajectory's). ``curation`` is the curate stage's snapshot
    (CURATION_FRAME_COLUMNS), which is the current truth (an exclusion lifted after the rollout is lifted); with
    None, the ``excluded`` flags the rollout exported are used. Stats: curated_excluded_trajectories (whole
    trajectories excluded), curated_excluded_steps (rows dropped), curated_labelled_steps (kept rows labelled)."""
    out = frame.copy()
    out["label"] = out["label"] if "label" in out.columns else ""
    excluded = out["excluded"].astype(bool) if "excluded" in out.columns else pd.Series(False, index=out.index)
    whole_excluded = pd.Series(False, index=out.index)
    if curation is not None:
        whole = curation[curation["step_index"] == -1].set_index("trajectory_id")
        steps = curation[curation["step_index"] >= 0].set_index(["trajectory_id", "step_index"])
        keys = list(zip(out["trajectory_id"], out["step_index"].astype(int)))
        whole_excluded = out["trajectory_id"].map(whole["excluded"]).fillna(False).astype(bool)
        step_excluded = pd.Series([bool(steps["excluded"].get(k, False)) for k in keys], index=out.index, dtype=bool)
        step_label = pd.Series([steps["label"].get(k, "") for k in keys], index=out.index, dtype=object)
        traj_label = out["trajectory_id"].map(whole["label"]).fillna("")
        out["label"] = step_label.where(step_label != "", traj_label)
        excluded = whole_excluded | step_excluded
    stats = {"curated_excluded_trajectories": int(out.loc[whole_excluded, "trajectory_id"].nunique()),
             "curated_excluded_steps": int(excluded.sum())}
    out = out[~excluded].assign(excluded=False).reset_index(drop=True)
    stats["curated_labelled_steps"] = int((out["label"] != "").sum())
    return out, stats


def drop_failed(frame: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, int]]:
    """``frame`` without the steps of trajectories whose env raised or timed out (status "failed"): their outcome
    is an accident of the env, not the policy's. Stats: failed_trajectories, failed_steps."""
    failed = frame["status"] == "failed"
    stats = {"failed_trajectories": int(frame.loc[failed, "trajectory_id"].nunique()),
             "failed_steps": int(failed.sum())}
    return frame[~failed].reset_index(drop=True), stats
