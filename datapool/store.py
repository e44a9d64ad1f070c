"""The durable data pool: every trajectory and step of every round, in SQLite (WAL) or PostgreSQL.

One class, ``DataPool(url)``, on SQLAlchemy 2's typed ORM. Token ids are stored compactly as little-endian int32
bytes and rollout log-probs as float32 bytes; the frames decode them back to Python lists. Writes are validated
first and happen in one transaction, so bad input never leaves a partial round in the pool.
"""
from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd
from sqlalchemy import (JSON, Boolean, Double, ForeignKey, Integer, LargeBinary, Text, UniqueConstraint, create_engine,
                        event, func, insert, inspect, select, text)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from datapool.parquet import export_steps
from datapool.records import TRAJECTORY_STATUSES, StepRecord, TrajectoryRecord

SCHEMA_VERSION = 3
"""Version of the tables below; bump it (and add a step to MIGRATIONS) whenever a column changes."""

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_ID_CHUNK = 500  # ids per IN (...) query: well under every backend's bound-parameter limit

TRAJECTORY_COLUMNS: tuple[str, ...] = (
    "trajectory_id", "group_id", "scenario", "env", "split", "round", "policy_version", "status",
    "episode_return", "won", "num_steps", "response_tokens", "wall_time_s", "error", "metadata",
)
STEP_COLUMNS: tuple[str, ...] = (
    "trajectory_id", "group_id", "step_index", "prompt_ids", "response_ids", "logprobs", "prompt_text",
    "observation", "action", "response_text", "reward", "anchor", "policy_version", "action_valid", "truncated",
    "skill_ids", "context_manager", "tool_calls", "tool_successes", "process_reward",
)
STEP_TRAJECTORY_COLUMNS: tuple[str, ...] = ("round", "env", "split", "status", "won", "episode_return")
"""Trajectory fields joined onto every row of ``steps_frame`` (group_id is already a step field)."""


class SchemaVersionError(RuntimeError):
    """The database was written by a different (usually newer) arlflow schema."""


class Base(DeclarativeBase):
    pass


class SchemaVersionRow(Base):
    __tablename__ = "schema_version"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(Integer)


class TrajectoryRow(Base):
    __tablename__ = "trajectories"
    trajectory_id: Mapped[str] = mapped_column(Text, primary_key=True)
    group_id: Mapped[str] = mapped_column(Text, index=True)
    scenario: Mapped[str] = mapped_column(Text)
    env: Mapped[str] = mapped_column(Text, index=True)
    split: Mapped[str] = mapped_column(Text)
    round: Mapped[int] = mapped_column(Integer, index=True)
    policy_version: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text)
    episode_return: Mapped[float] = mapped_column(Double)
    won: Mapped[bool] = mapped_column(Boolean)
    num_steps: Mapped[int] = mapped_column(Integer)
    response_tokens: Mapped[int] = mapped_column(Integer)
    wall_time_s: Mapped[float] = mapped_column(Double)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)  # `metadata` is reserved on ORM classes


class StepRow(Base):
    __tablename__ = "steps"
    __table_args__ = (UniqueConstraint("trajectory_id", "step_index", name="uq_steps_trajectory_step"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    trajectory_id: Mapped[str] = mapped_column(ForeignKey("trajectories.trajectory_id"))
    group_id: Mapped[str] = mapped_column(Text)
    step_index: Mapped[int] = mapped_column(Integer)
    prompt_ids: Mapped[bytes] = mapped_column(LargeBinary)    # little-endian int32
    response_ids: Mapped[bytes] = mapped_column(LargeBinary)  # little-endian int32
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)      # little-endian float32
    prompt_text: Mapped[str] = mapped_column(Text)
    observation: Mapped[str] = mapped_column(Text)
    action: Mapped[str] = mapped_column(Text)
    response_text: Mapped[str] = mapped_column(Text)
    reward: Mapped[float] = mapped_column(Double)
    anchor: Mapped[str] = mapped_column(Text)
    policy_version: Mapped[str] = mapped_column(Text)
    action_valid: Mapped[bool] = mapped_column(Boolean)
    truncated: Mapped[bool] = mapped_column(Boolean)
    skill_ids: Mapped[list[str]] = mapped_column(JSON)
    context_manager: Mapped[str] = mapped_column(Text)
    tool_calls: Mapped[int] = mapped_column(Integer, server_default=text("0"))      # schema version 2
    tool_successes: Mapped[int] = mapped_column(Integer, server_default=text("0"))  # schema version 2
    process_reward: Mapped[float] = mapped_column(Double, server_default=text("0"))  # schema version 3


# ---------------------------------------------------------------------------------------------- migrations

def _add_step_tool_counts(conn: Connection) -> None:
    """Version 1 -> 2: per-step tool-call bookkeeping; steps written before it made no recorded tool calls."""
    present = {column["name"] for column in inspect(conn).get_columns(StepRow.__tablename__)}
    for name in ("tool_calls", "tool_successes"):
        if name not in present:
            conn.execute(text(f"ALTER TABLE {StepRow.__tablename__} ADD COLUMN {name} INTEGER NOT NULL DEFAULT 0"))


def _add_step_process_reward(conn: Connection) -> None:
    """Version 2 -> 3: the fold context manager's per-step process reward; older steps had none (0)."""
    present = {column["name"] for column in inspect(conn).get_columns(StepRow.__tablename__)}
    if "process_reward" not in present:
        conn.execute(text(f"ALTER TABLE {StepRow.__tablename__} ADD COLUMN process_reward FLOAT NOT NULL DEFAULT 0"))


MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: _add_step_tool_counts, 2: _add_step_process_reward}
"""from_version -> the step that brings a pool from that version to the next one (DDL only; the version row is
updated by ``DataPool``). Every version below SCHEMA_VERSION needs an entry."""


# ----------------------------------------------------------------------------------------------- encoding

def encode_ids(ids: Iterable[int]) -> bytes:
    """Token ids as little-endian int32 bytes (4 bytes per id)."""
    return np.asarray(list(ids), dtype=np.int64).astype("<i4").tobytes()


def decode_ids(blob: bytes) -> list[int]:
    return np.frombuffer(blob, dtype="<i4").tolist()


def encode_logprobs(logprobs: Iterable[float]) -> bytes:
    """Log-probs as little-endian float32 bytes (the precision the trainer uses)."""
    return np.asarray(list(logprobs), dtype=np.float64).astype("<f4").tobytes()


def decode_logprobs(blob: bytes) -> list[float]:
    return np.frombuffer(blob, dtype="<f4").tolist()


# --------------------------------------------------------------------------------------------- validation

def _fail(traj_id: str, where: str, message: str) -> ValueError:
    return ValueError(f"invalid trajectory {traj_id!r}: {where} {message}; nothing was written")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_ids(tid: str, where: str, ids: Any) -> None:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise _fail(tid, where, f"must be a flat list of ints, got dtype {arr.dtype} with shape {arr.shape}")
    if arr.size and (arr.min() < _INT32_MIN or arr.max() > _INT32_MAX):
        raise _fail(tid, where, "holds an id outside the int32 range")


def _check_step(tid: str, traj: TrajectoryRecord, step: StepRecord) -> None:
    where = f"step {step.step_index!r} field"
    if step.trajectory_id != tid:
        raise _fail(tid, f"{where} 'trajectory_id'", f"is {step.trajectory_id!r}, not its trajectory's id")
    if step.group_id != traj.group_id:
        raise _fail(tid, f"{where} 'group_id'", f"is {step.group_id!r}, its trajectory's is {traj.group_id!r}")
    if not _is_int(step.step_index) or step.step_index < 0:
        raise _fail(tid, f"{where} 'step_index'", "must be an int >= 0")
    _check_ids(tid, f"{where} 'prompt_ids'", step.prompt_ids)
    _check_ids(tid, f"{where} 'response_ids'", step.response_ids)
    logprobs = np.asarray(step.logprobs)
    if logprobs.ndim != 1 or (logprobs.size and logprobs.dtype.kind not in "iuf"):
        raise _fail(tid, f"{where} 'logprobs'", "must be a flat list of floats")
    if len(logprobs) != len(step.response_ids):
        raise _fail(tid, f"{where} 'logprobs'",
                    f"has {len(logprobs)} values for {len(step.response_ids)} response_ids (must be equal)")
    if not _is_real(step.process_reward) or not math.isfinite(step.process_reward):
        raise _fail(tid, f"{where} 'process_reward'", f"must be a finite real number; got {step.process_reward!r}")
    if not _is_real(step.reward) or math.isnan(step.reward):
        # SQL backends cannot round-trip NaN faithfully (SQLite stores it as NULL)
        raise _fail(tid, f"{where} 'reward'", f"must be a real number, not NaN; got {step.reward!r}")
    for name in ("prompt_text", "observation", "action", "response_text", "anchor", "policy_version",
                 "context_manager"):
        if not isinstance(getattr(step, name), str):
            raise _fail(tid, f"{where} {name!r}", f"must be a str, got {type(getattr(step, name)).__name__}")
    for name in ("action_valid", "truncated"):
        if not isinstance(getattr(step, name), (bool, np.bool_)):
            raise _fail(tid, f"{where} {name!r}", "must be a bool")
    for name in ("tool_calls", "tool_successes"):
        if not _is_int(getattr(step, name)) or not 0 <= getattr(step, name) <= _INT32_MAX:
            raise _fail(tid, f"{where} {name!r}", f"must be an int >= 0, got {getattr(step, name)!r}")
    if step.tool_successes > step.tool_calls:
        raise _fail(tid, f"{where} 'tool_successes'",
                    f"is {step.tool_successes}, more than the step's {step.tool_calls} tool_calls")
    if not isinstance(step.skill_ids, (list, tuple)) or not all(isinstance(s, str) for s in step.skill_ids):
        raise _fail(tid, f"{where} 'skill_ids'", "must be a list of str")


def validate_trajectory(traj: TrajectoryRecord) -> None:
    """Raise ValueError naming the trajectory and field if ``traj`` (or one of its steps) cannot be stored."""
    tid = traj.trajectory_id
    if not isinstance(tid, str) or not tid:
        raise ValueError(f"invalid trajectory {tid!r}: field 'trajectory_id' must be a non-empty str")
    for name in ("group_id", "env", "split", "policy_version"):
        if not isinstance(getattr(traj, name), str) or not getattr(traj, name):
            raise _fail(tid, f"field {name!r}", "must be a non-empty str")
    if not isinstance(traj.scenario, str):
        raise _fail(tid, "field 'scenario'", "must be a str (Scenario.to_json())")
    if traj.status not in TRAJECTORY_STATUSES:
        raise _fail(tid, "field 'status'", f"is {traj.status!r}; valid statuses: {', '.join(TRAJECTORY_STATUSES)}")
    for name in ("round", "num_steps", "response_tokens"):
        if not _is_int(getattr(traj, name)) or getattr(traj, name) < 0:
            raise _fail(tid, f"field {name!r}", f"must be an int >= 0, got {getattr(traj, name)!r}")
    for name in ("episode_return", "wall_time_s"):
        if not _is_real(getattr(traj, name)) or math.isnan(getattr(traj, name)):
            raise _fail(tid, f"field {name!r}", f"must be a real number, not NaN; got {getattr(traj, name)!r}")
    if not isinstance(traj.won, (bool, np.bool_)):
        raise _fail(tid, "field 'won'", "must be a bool")
    if traj.error is not None and not isinstance(traj.error, str):
        raise _fail(tid, "field 'error'", "must be a str or None")
    if not isinstance(traj.metadata, dict):
        raise _fail(tid, "field 'metadata'", "must be a dict")
    try:
        json.dumps(traj.metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _fail(tid, "field 'metadata'", f"is not JSON-serializable ({exc})") from None
    seen: set[int] = set()
    for step in traj.steps:
        _check_step(tid, traj, step)
        if step.step_index in seen:
            raise _fail(tid, f"step {step.step_index} field 'step_index'", "appears twice")
        seen.add(step.step_index)


def _trajectory_row(traj: TrajectoryRecord) -> dict[str, Any]:
    return {
        "trajectory_id": traj.trajectory_id, "group_id": traj.group_id, "scenario": traj.scenario,
        "env": traj.env, "split": traj.split, "round": int(traj.round), "policy_version": traj.policy_version,
        "status": traj.status, "episode_return": float(traj.episode_return), "won": bool(traj.won),
        "num_steps": int(traj.num_steps), "response_tokens": int(traj.response_tokens),
        "wall_time_s": float(traj.wall_time_s), "error": traj.error, "meta": traj.metadata,
    }


def _step_row(step: StepRecord) -> dict[str, Any]:
    return {
        "trajectory_id": step.trajectory_id, "group_id": step.group_id, "step_index": int(step.step_index),
        "prompt_ids": encode_ids(step.prompt_ids), "response_ids": encode_ids(step.response_ids),
        "logprobs": encode_logprobs(step.logprobs), "prompt_text": step.prompt_text,
        "observation": step.observation, "action": step.action, "response_text": step.response_text,
        "reward": float(step.reward), "anchor": step.anchor, "policy_version": step.policy_version,
        "action_valid": bool(step.action_valid), "truncated": bool(step.truncated),
        "skill_ids": list(step.skill_ids), "context_manager": step.context_manager,
        "tool_calls": int(step.tool_calls), "tool_successes": int(step.tool_successes),
        "process_reward": float(step.process_reward),
    }


# ------------------------------------------------------------------------------------------------ the pool

def _sqlite_pragmas(busy_timeout_ms: int):
    def on_connect(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the rollout's writer
        cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")  # writers wait instead of failing at once
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()
    return on_connect


def _engine_for(url: str, busy_timeout_s: float) -> Engine:
    if "://" not in url:  # a bare path means a SQLite file
        url = f"sqlite:///{url}"
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True)
    if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed)
    event.listen(engine, "connect", _sqlite_pragmas(int(busy_timeout_s * 1000)))
    return engine


class DataPool:
    """Trajectories and steps of every round. ``url``: a SQLAlchemy URL (``sqlite:///data/pool.db``,
    ``postgresql+psycopg://...``) or a bare file path (SQLite). Use as a context manager or call ``close()``."""

    def __init__(self, url: str, *, busy_timeout_s: float = 30.0) -> None:
        self.url = url
        self.engine = _engine_for(url, busy_timeout_s)
        try:
            self._open_schema()
        except BaseException:
            self.engine.dispose()
            raise

    def _stored_version(self) -> int | None:
        if not inspect(self.engine).has_table(SchemaVersionRow.__tablename__):
            return None
        with Session(self.engine) as session:
            return session.scalar(select(SchemaVersionRow.version).where(SchemaVersionRow.id == 1))

    def _open_schema(self) -> None:
        found = self._stored_version()
        if found is not None and found > SCHEMA_VERSION:
            raise SchemaVersionError(f"data pool {self.url} has schema version {found}, this arlflow reads version "
                                     f"{SCHEMA_VERSION}: upgrade arlflow to open it")
        if found is not None and found < SCHEMA_VERSION:
            self._migrate(found)
        Base.metadata.create_all(self.engine)  # checkfirst: creates only what is missing
        try:
            with Session(self.engine) as session, session.begin():
                if session.get(SchemaVersionRow, 1) is None:
                    session.add(SchemaVersionRow(id=1, version=SCHEMA_VERSION))
        except IntegrityError:  # another process created it at the same moment
            pass

    def _migrate(self, found: int) -> None:
        """Bring a pool at version ``found`` to SCHEMA_VERSION in one transaction: all steps or none."""
        missing = [v for v in range(found, SCHEMA_VERSION) if v not in MIGRATIONS]
        if missing:
            raise SchemaVersionError(f"data pool {self.url} has schema version {found} and arlflow has no migration "
                                     f"from version(s) {missing}: start a fresh pool")
        with self.engine.begin() as conn:
            if conn.dialect.name == "sqlite":
                # pysqlite commits DDL on its own unless a transaction is open; IMMEDIATE also takes the write lock,
                # so a second process opening the same pool waits here and then sees the new version
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            current = conn.scalar(select(SchemaVersionRow.version).where(SchemaVersionRow.id == 1).with_for_update())
            for version in range(current, SCHEMA_VERSION):
                MIGRATIONS[version](conn)
            if current < SCHEMA_VERSION:
                conn.execute(text("UPDATE schema_version SET version = :v WHERE id = 1"), {"v": SCHEMA_VERSION})

    # -- writing

    def add_trajectories(self, trajs: list[TrajectoryRecord]) -> int:
        """Store ``trajs`` and their steps in one transaction; return how many were new.

        Idempotent on trajectory_id: ids already in the pool are skipped (counted as 0). Every record is
        validated first; if any is invalid, ValueError names it and its field and nothing is written.
        """
        seen: set[str] = set()
        for traj in trajs:
            validate_trajectory(traj)
            if traj.trajectory_id in seen:
                raise _fail(traj.trajectory_id, "field 'trajectory_id'", "appears twice in this batch")
            seen.add(traj.trajectory_id)
        if not trajs:
            return 0
        for attempt in range(2):
            try:
                return self._insert_new(trajs)
            except IntegrityError:
                # a concurrent writer added some of these ids between our check and insert: re-check once
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def _insert_new(self, trajs: list[TrajectoryRecord]) -> int:
        ids = [t.trajectory_id for t in trajs]
        with Session(self.engine) as session, session.begin():
            existing: set[str] = set()
            for start in range(0, len(ids), _ID_CHUNK):
                chunk = ids[start:start + _ID_CHUNK]
                existing.update(session.scalars(
                    select(TrajectoryRow.trajectory_id).where(TrajectoryRow.trajectory_id.in_(chunk))))
            new = [t for t in trajs if t.trajectory_id not in existing]
            if not new:
                return 0
            session.execute(insert(TrajectoryRow), [_trajectory_row(t) for t in new])
            step_rows = [_step_row(s) for t in new for s in t.steps]
            if step_rows:
                session.execute(insert(StepRow), step_rows)
        return len(new)

    # -- reading

    def trajectories_frame(self, *, round: int | None = None, env: str | None = None,
                           split: str | None = None) -> pd.DataFrame:
        """One row per trajectory (all TrajectoryRecord fields but steps), ordered by round, group, id."""
        stmt = select(TrajectoryRow)
        if round is not None:
            stmt = stmt.where(TrajectoryRow.round == round)
        if env is not None:
            stmt = stmt.where(TrajectoryRow.env == env)
        if split is not None:
            stmt = stmt.where(TrajectoryRow.split == split)
        stmt = stmt.order_by(TrajectoryRow.round, TrajectoryRow.group_id, TrajectoryRow.trajectory_id)
        with Session(self.engine) as session:
            rows = [
                {name: getattr(row, "meta" if name == "metadata" else name) for name in TRAJECTORY_COLUMNS}
                for row in session.scalars(stmt)
            ]
        return pd.DataFrame(rows, columns=list(TRAJECTORY_COLUMNS))

    def steps_frame(self, *, round: int | None = None, env: str | None = None) -> pd.DataFrame:
        """One row per step, with its trajectory's round/env/split/status/won/episode_return joined on.

        ``prompt_ids``/``response_ids`` are lists of int and ``logprobs`` lists of float (float32 precision).
        Ordered by round, group, trajectory, step index.
        """
        stmt = select(StepRow, *(getattr(TrajectoryRow, c) for c in STEP_TRAJECTORY_COLUMNS)).join(
            TrajectoryRow, StepRow.trajectory_id == TrajectoryRow.trajectory_id)
        if round is not None:
            stmt = stmt.where(TrajectoryRow.round == round)
        if env is not None:
            stmt = stmt.where(TrajectoryRow.env == env)
        stmt = stmt.order_by(TrajectoryRow.round, StepRow.group_id, StepRow.trajectory_id, StepRow.step_index)
        records = []
        with Session(self.engine) as session:
            for step, *joined in session.execute(stmt):
                record = {name: getattr(step, name) for name in STEP_COLUMNS}
                record["prompt_ids"] = decode_ids(step.prompt_ids)
                record["response_ids"] = decode_ids(step.response_ids)
                record["logprobs"] = decode_logprobs(step.logprobs)
                record["skill_ids"] = list(step.skill_ids)
                record.update(zip(STEP_TRAJECTORY_COLUMNS, joined))
                records.append(record)
        return pd.DataFrame(records, columns=[*STEP_COLUMNS, *STEP_TRAJECTORY_COLUMNS])

    def counts(self) -> dict[str, int]:
        with Session(self.engine) as session:
            return {
                "trajectories": session.scalar(select(func.count()).select_from(TrajectoryRow)) or 0,
                "steps": session.scalar(select(func.count()).select_from(StepRow)) or 0,
            }

    def export_round(self, round: int, path: str | Path) -> int:
        """Write the steps of ``round`` to a Parquet file at ``path`` (see ``datapool.parquet``); return rows."""
        df = self.steps_frame(round=round)
        metadata = {
            "round": round,
            "policy_versions": sorted(set(df["policy_version"])),
            "trajectories": int(df["trajectory_id"].nunique()),
            "pool_schema_version": SCHEMA_VERSION,
        }
        export_steps(df, path, metadata=metadata)
        return len(df)

    # -- lifetime

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> DataPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
