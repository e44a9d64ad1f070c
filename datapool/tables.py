"""The data pool's tables (SQLAlchemy 2 typed ORM), their schema version and migrations, how records map to rows
(token ids and log-probs encoded compactly), and the engine with its SQLite settings.

Token ids are stored as little-endian int32 bytes and rollout log-probs as float32 bytes. Curation (labels and
exclusions) lives in its own table, so curating never rewrites a step; rows there are updated, never deleted.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from sqlalchemy import (JSON, Boolean, Double, ForeignKey, Index, Integer, LargeBinary, Text, TypeDecorator,
                        UniqueConstraint, create_engine, event, func, inspect, text)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from datapool.records import StepRecord, TrajectoryRecord

STEP_COLUMNS: tuple[str, ...] = (
    "trajectory_id", "group_id", "step_index", "prompt_ids", "response_ids", "logprobs", "prompt_text",
    "observation", "action", "response_text", "reward", "anchor", "policy_version", "action_valid", "truncated",
    "skill_ids", "context_manager", "tool_calls", "tool_successes", "process_reward", "retokenized",
)
"""StepRecord's fields, the step columns of ``DataPool.steps_frame``."""

SCHEMA_VERSION = 4
"""Version of the tables below; bump it (and add a step to MIGRATIONS) whenever a column changes."""

CURATION_KINDS = ("trajectory", "step")


class DisplayText(TypeDecorator):
    """Text that may hold anything a model generated. PostgreSQL text cannot store NUL (\\x00), which untrained
    models do sample: there it is stored as U+FFFD. Only the human-readable text changes; token ids are exact."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        if value is not None and dialect.name == "postgresql" and "\x00" in value:
            return value.replace("\x00", "\ufffd")
        return value


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
    error: Mapped[str | None] = mapped_column(DisplayText, nullable=True)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)  # `metadata` is reserved on ORM classes
    created_at: Mapped[float] = mapped_column(Double, server_default=text("0"), index=True)  # version 4; epoch s


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
    prompt_text: Mapped[str] = mapped_column(DisplayText)
    observation: Mapped[str] = mapped_column(DisplayText)
    action: Mapped[str] = mapped_column(DisplayText)
    response_text: Mapped[str] = mapped_column(DisplayText)
    reward: Mapped[float] = mapped_column(Double)
    anchor: Mapped[str] = mapped_column(DisplayText)
    policy_version: Mapped[str] = mapped_column(Text)
    action_valid: Mapped[bool] = mapped_column(Boolean)
    truncated: Mapped[bool] = mapped_column(Boolean)
    skill_ids: Mapped[list[str]] = mapped_column(JSON)
    context_manager: Mapped[str] = mapped_column(Text)
    tool_calls: Mapped[int] = mapped_column(Integer, server_default=text("0"))      # schema version 2
    tool_successes: Mapped[int] = mapped_column(Integer, server_default=text("0"))  # schema version 2
    process_reward: Mapped[float] = mapped_column(Double, server_default=text("0"))  # schema version 3
    retokenized: Mapped[bool] = mapped_column(Boolean, server_default=text("FALSE"))  # schema version 4


class CurationRow(Base):
    """A label and/or exclusion of one trajectory (step_index NULL) or one step. Schema version 4."""
    __tablename__ = "curation"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(Text)  # one of CURATION_KINDS
    trajectory_id: Mapped[str] = mapped_column(ForeignKey("trajectories.trajectory_id"))
    step_index: Mapped[int | None] = mapped_column(Integer, nullable=True)
    excluded: Mapped[bool] = mapped_column(Boolean)
    label: Mapped[str | None] = mapped_column(Text, nullable=True)
    note: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[float] = mapped_column(Double)  # epoch seconds


# one curation row per target; a NULL step_index (the trajectory itself) counts as -1, so it is unique too
Index("uq_curation_target", CurationRow.trajectory_id, func.coalesce(CurationRow.step_index, -1), unique=True)


class RequestRow(Base):
    """A gateway request already recorded, by its client's idempotency key. Schema version 4."""
    __tablename__ = "requests"
    idempotency_key: Mapped[str] = mapped_column(Text, primary_key=True)
    trajectory_id: Mapped[str] = mapped_column(ForeignKey("trajectories.trajectory_id"))
    step_index: Mapped[int] = mapped_column(Integer)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[float] = mapped_column(Double)  # epoch seconds


# ---------------------------------------------------------------------------------------------- migrations

def _columns(conn: Connection, table: str) -> set[str]:
    return {column["name"] for column in inspect(conn).get_columns(table)}


def _add_step_tool_counts(conn: Connection) -> None:
    """Version 1 -> 2: per-step tool-call bookkeeping; steps written before it made no recorded tool calls."""
    present = _columns(conn, StepRow.__tablename__)
    for name in ("tool_calls", "tool_successes"):
        if name not in present:
            conn.execute(text(f"ALTER TABLE {StepRow.__tablename__} ADD COLUMN {name} INTEGER NOT NULL DEFAULT 0"))


def _add_step_process_reward(conn: Connection) -> None:
    """Version 2 -> 3: the fold context manager's per-step process reward; older steps had none (0)."""
    if "process_reward" not in _columns(conn, StepRow.__tablename__):
        conn.execute(text(f"ALTER TABLE {StepRow.__tablename__} ADD COLUMN process_reward FLOAT NOT NULL DEFAULT 0"))


def _add_gateway_columns(conn: Connection) -> None:
    """Version 3 -> 4: steps.retokenized (older steps carried the engine's own ids: FALSE), trajectories.created_at
    (unknown for older rows: 0, so they sort as oldest). The new curation and requests tables are created after the
    migrations by ``create_all``."""
    if "retokenized" not in _columns(conn, StepRow.__tablename__):
        conn.execute(text(f"ALTER TABLE {StepRow.__tablename__} ADD COLUMN retokenized BOOLEAN NOT NULL "
                          f"DEFAULT FALSE"))
    if "created_at" not in _columns(conn, TrajectoryRow.__tablename__):
        conn.execute(text(f"ALTER TABLE {TrajectoryRow.__tablename__} ADD COLUMN created_at FLOAT NOT NULL DEFAULT 0"))
        conn.execute(text(f"CREATE INDEX IF NOT EXISTS ix_trajectories_created_at ON "
                          f"{TrajectoryRow.__tablename__} (created_at)"))


MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _add_step_tool_counts, 2: _add_step_process_reward, 3: _add_gateway_columns,
}
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


# ------------------------------------------------------------------------------------------ records <-> rows

def trajectory_row(traj: TrajectoryRecord, created_at: float) -> dict[str, Any]:
    return {
        "trajectory_id": traj.trajectory_id, "group_id": traj.group_id, "scenario": traj.scenario,
        "env": traj.env, "split": traj.split, "round": int(traj.round), "policy_version": traj.policy_version,
        "status": traj.status, "episode_return": float(traj.episode_return), "won": bool(traj.won),
        "num_steps": int(traj.num_steps), "response_tokens": int(traj.response_tokens),
        "wall_time_s": float(traj.wall_time_s), "error": traj.error, "metadata": traj.metadata,
        "created_at": created_at,
    }


def step_row(step: StepRecord) -> dict[str, Any]:
    return {
        "trajectory_id": step.trajectory_id, "group_id": step.group_id, "step_index": int(step.step_index),
        "prompt_ids": encode_ids(step.prompt_ids), "response_ids": encode_ids(step.response_ids),
        "logprobs": encode_logprobs(step.logprobs), "prompt_text": step.prompt_text,
        "observation": step.observation, "action": step.action, "response_text": step.response_text,
        "reward": float(step.reward), "anchor": step.anchor, "policy_version": step.policy_version,
        "action_valid": bool(step.action_valid), "truncated": bool(step.truncated),
        "skill_ids": list(step.skill_ids), "context_manager": step.context_manager,
        "tool_calls": int(step.tool_calls), "tool_successes": int(step.tool_successes),
        "process_reward": float(step.process_reward), "retokenized": bool(step.retokenized),
    }


def decoded_step(row: Any) -> dict[str, Any]:
    """A steps row (Core Row) as a dict of STEP_COLUMNS with ids and log-probs decoded to lists."""
    record = {name: row._mapping[name] for name in STEP_COLUMNS}
    record["prompt_ids"] = decode_ids(row.prompt_ids)
    record["response_ids"] = decode_ids(row.response_ids)
    record["logprobs"] = decode_logprobs(row.logprobs)
    record["skill_ids"] = list(row.skill_ids)
    record["action_valid"], record["truncated"] = bool(row.action_valid), bool(row.truncated)
    record["retokenized"] = bool(row.retokenized)
    return record


# ------------------------------------------------------------------------------------------------- engine

SQLITE_SYNCHRONOUS = ("FULL", "NORMAL")
"""FULL: every commit is fsynced (survives power loss; ~3-4 ms a commit on an ordinary disk). NORMAL: WAL commits
reach the OS before the call returns, so they survive the process being killed (kill -9) but not a power loss;
~5x faster writes."""


def _sqlite_pragmas(busy_timeout_ms: int, synchronous: str):
    def on_connect(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")  # writers wait instead of failing at once
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()
    return on_connect


def make_engine(url: str, busy_timeout_s: float, synchronous: str) -> Engine:
    """The engine for ``url`` (a bare path means a SQLite file, whose folder is created): SQLite in WAL mode with a
    busy timeout and foreign keys on; other backends as SQLAlchemy makes them, with pre-ping."""
    if "://" not in url:
        url = f"sqlite:///{url}"
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True)
    if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed)
    event.listen(engine, "connect", _sqlite_pragmas(int(busy_timeout_s * 1000), synchronous))
    return engine
