"""The data pool's tables (SQLAlchemy 2 Core), their schema version and migrations, how records map to rows
(token ids and log-probs encoded compactly), and the engine with its SQLite settings.

The ``trajectories`` and ``steps`` columns, their row encoders/decoders and the migrations that add columns are
derived from the record declarations (``datapool.records``; kinds map to SQL types in SQL_KINDS). Token ids are
stored as little-endian int32 bytes, lists of id lists as int32 bytes with a length header, rollout log-probs as
float32 bytes. Curation (labels and exclusions) lives in its own table, so curating never rewrites a step; rows
there are updated, never deleted.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from sqlalchemy import (JSON, Boolean, Column, Double, ForeignKey, Index, Integer, LargeBinary, Table, Text,
                        TypeDecorator, UniqueConstraint, create_engine, event, false, func, inspect, text, true)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.sql.expression import ColumnElement

from datapool.records import ROW_TRAJECTORY_FIELDS, STEP_FIELDS, TRAJECTORY_FIELDS, StepRecord, TrajectoryRecord
from datapool.schema import FieldSpec, spec

SCHEMA_VERSION = 8
"""Version of the tables below. Adding a column: declare its field with ``since=SCHEMA_VERSION + 1`` and bump this;
the migration that adds it (with its default) is derived. Other changes need a hand-written step in MIGRATIONS."""

STEP_COLUMNS: tuple[str, ...] = tuple(f.name for f in STEP_FIELDS)
"""StepRecord's fields, the step columns of ``DataPool.steps_frame``."""
TRAJECTORY_COLUMNS: tuple[str, ...] = tuple(f.name for f in TRAJECTORY_FIELDS)
"""TrajectoryRecord's fields but steps: the columns of ``DataPool.trajectories_frame``."""

POOL_TRAJECTORY_FIELDS: tuple[FieldSpec, ...] = (
    spec("created_at", "float", "when the pool stored the trajectory, epoch s (0 for rows older than version 4: they "
         "sort as oldest)", since=4, default=0.0, index=True),
)
"""Trajectory columns the pool keeps that are no record's field."""

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


# ----------------------------------------------------------------------------------------------- encoding

def encode_ids(ids: Iterable[int]) -> bytes:
    """Token ids as little-endian int32 bytes (4 bytes per id)."""
    values = ids if isinstance(ids, list) else list(ids)
    if not values:  # most steps have no skill trace: skip numpy for the empty ones
        return b""
    return np.asarray(values, dtype=np.int64).astype("<i4").tobytes()


def decode_ids(blob: bytes) -> list[int]:
    return np.frombuffer(blob, dtype="<i4").tolist()


def encode_logprobs(logprobs: Iterable[float]) -> bytes:
    """Log-probs as little-endian float32 bytes (the precision the trainer uses)."""
    return np.asarray(list(logprobs), dtype=np.float64).astype("<f4").tobytes()


def decode_logprobs(blob: bytes) -> list[float]:
    return np.frombuffer(blob, dtype="<f4").tolist()


def encode_id_lists(lists: Iterable[Iterable[int]]) -> bytes:
    """A list of id lists as little-endian int32 bytes: [n, len_1..len_n, ids_1..., ids_n...]; [] is b""."""
    if isinstance(lists, list) and not lists:
        return b""
    parts = [list(ids) for ids in lists]
    if not parts:
        return b""
    header = [len(parts), *(len(ids) for ids in parts)]
    return np.asarray(header + [i for ids in parts for i in ids], dtype=np.int64).astype("<i4").tobytes()


def decode_id_lists(blob: bytes) -> list[list[int]]:
    values = np.frombuffer(blob, dtype="<i4")
    if not values.size:
        return []
    count = int(values[0])
    lengths, flat = values[1:1 + count], values[1 + count:]
    if len(lengths) != count or int(lengths.sum()) != len(flat):
        raise ValueError(f"a stored id-list column is corrupt: header says {count} lists of {lengths.tolist()} ids, "
                         f"{len(flat)} ids follow")
    return [part.tolist() for part in np.split(flat, np.cumsum(lengths)[:-1])]


@dataclass(frozen=True)
class SqlKind:
    """How a field kind is stored: its column type and the value conversions (None: stored as it is)."""

    type: Callable[[], Any]
    encode: Callable[[Any], Any] | None
    decode: Callable[[Any], Any] | None


SQL_KINDS: dict[str, SqlKind] = {
    "ids": SqlKind(LargeBinary, encode_ids, decode_ids),
    "logprobs": SqlKind(LargeBinary, encode_logprobs, decode_logprobs),
    "id_lists": SqlKind(LargeBinary, encode_id_lists, decode_id_lists),
    "text": SqlKind(DisplayText, None, None),
    "str": SqlKind(Text, None, None),
    "int": SqlKind(Integer, int, None),
    "float": SqlKind(Double, float, None),
    "bool": SqlKind(Boolean, bool, bool),
    "strs": SqlKind(JSON, list, list),
    "json": SqlKind(JSON, None, None),
}
"""schema kind -> SQL storage (every kind in datapool.schema.KINDS)."""


class _EmptyBinary(ColumnElement):
    """The empty byte string as a column default (SQLite needs X'': a plain '' would be stored as text)."""

    inherit_cache = True


@compiles(_EmptyBinary)
def _empty_binary(element: _EmptyBinary, compiler: Any, **kw: Any) -> str:
    return "''"


@compiles(_EmptyBinary, "sqlite")
def _empty_binary_sqlite(element: _EmptyBinary, compiler: Any, **kw: Any) -> str:
    return "X''"


def _server_default(field: FieldSpec) -> Any:
    """The SQL default of a column added after version 1 (what rows older than ``field.since`` get)."""
    if field.since == 1 or field.default is None:
        return None
    value, kind = field.default, field.kind
    if SQL_KINDS[kind].type is LargeBinary:
        if SQL_KINDS[kind].encode(value) != b"":
            raise ValueError(f"field {field.name!r}: a binary column's default must encode to no bytes")
        return _EmptyBinary()
    if kind == "bool":
        return true() if value else false()
    if kind in ("int", "float"):
        return text(repr(SQL_KINDS[kind].encode(value)))
    literal = json.dumps(value) if kind in ("strs", "json") else str(value)
    return text("'" + literal.replace("'", "''") + "'")


def _column(field: FieldSpec, *extra: Any, **options: Any) -> Column:
    return Column(field.name, SQL_KINDS[field.kind].type(), *extra, nullable=field.nullable, index=field.index or None,
                  server_default=_server_default(field), **options)


# ----------------------------------------------------------------------------------------------- tables

class Base(DeclarativeBase):
    pass


class SchemaVersionRow(Base):
    __tablename__ = "schema_version"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(Integer)


TRAJECTORIES = Table(
    "trajectories", Base.metadata,
    *(_column(f, primary_key=f.name == "trajectory_id") for f in TRAJECTORY_FIELDS + POOL_TRAJECTORY_FIELDS))

STEPS = Table(
    "steps", Base.metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    *(_column(f, *([ForeignKey("trajectories.trajectory_id")] if f.name == "trajectory_id" else []))
      for f in STEP_FIELDS),
    UniqueConstraint("trajectory_id", "step_index", name="uq_steps_trajectory_step"))

_TABLE_FIELDS: tuple[tuple[Table, tuple[FieldSpec, ...]], ...] = (
    (TRAJECTORIES, TRAJECTORY_FIELDS + POOL_TRAJECTORY_FIELDS), (STEPS, STEP_FIELDS))

_newest = max(f.since for _, fields in _TABLE_FIELDS for f in fields)
if _newest > SCHEMA_VERSION:
    raise RuntimeError(f"a field is declared since schema version {_newest} but SCHEMA_VERSION is {SCHEMA_VERSION}: "
                       f"bump datapool.tables.SCHEMA_VERSION")


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

def add_columns_of(version: int, conn: Connection) -> None:
    """Version ``version - 1`` -> ``version``: add every column whose field was declared ``since=version`` (NOT NULL
    with its default, so older rows get the default) and its index. Tables new in ``version`` are created after
    the migrations by ``create_all``."""
    for table, fields in _TABLE_FIELDS:
        present = {column["name"] for column in inspect(conn).get_columns(table.name)}
        for field in fields:
            if field.since != version or field.name in present:
                continue
            column = table.c[field.name]
            ddl = f"{field.name} {column.type.compile(dialect=conn.dialect)}"
            if column.server_default is not None:  # unwrapped: older SQLite refuses "(expr)" in ADD COLUMN
                ddl += f" DEFAULT {column.server_default.arg.compile(dialect=conn.dialect)}"
            ddl += "" if field.nullable else " NOT NULL"
            conn.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {ddl}"))
            for index in table.indexes:
                if [c.name for c in index.columns] == [field.name]:
                    index.create(conn, checkfirst=True)


MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    version: partial(add_columns_of, version + 1) for version in range(1, SCHEMA_VERSION)}
"""from_version -> the step that brings a pool from that version to the next one (DDL only; the version row is
updated by ``DataPool``). Every version below SCHEMA_VERSION needs an entry. 1 -> 2: tool counts; 2 -> 3: process
reward; 3 -> 4: steps.retokenized, trajectories.created_at (+ the curation and requests tables); 4 -> 5: the skill
trace (plain_prompt_ids, macro_prompt_ids, macro_action_ids); 5 -> 6: action_choices; 6 -> 7: prefix_break; 7 -> 8: staleness."""


# ------------------------------------------------------------------------------------------ records <-> rows

def _encoders(fields: tuple[FieldSpec, ...]) -> tuple[tuple[str, Callable[[Any], Any] | None], ...]:
    return tuple((f.name, SQL_KINDS[f.kind].encode) for f in fields)


def _decoders(fields: tuple[FieldSpec, ...], prefix: str = "") -> tuple[tuple[str, str, Any], ...]:
    return tuple((f.name, prefix + f.name, SQL_KINDS[f.kind].decode) for f in fields)


_STEP_ENCODERS = _encoders(STEP_FIELDS)
_TRAJECTORY_ENCODERS = _encoders(TRAJECTORY_FIELDS)
_STEP_DECODERS = _decoders(STEP_FIELDS)
_TRAJECTORY_DECODERS = _decoders(TRAJECTORY_FIELDS)
ROW_PREFIX = "traj_"
"""Label prefix of the trajectory columns a step query joins on (``decoded_step_row``)."""
_ROW_DECODERS = _decoders(ROW_TRAJECTORY_FIELDS, ROW_PREFIX)


def trajectory_row(traj: TrajectoryRecord, created_at: float) -> dict[str, Any]:
    row: dict[str, Any] = {"created_at": created_at}
    for name, encode in _TRAJECTORY_ENCODERS:
        value = getattr(traj, name)
        row[name] = value if encode is None or value is None else encode(value)
    return row


def step_row(step: StepRecord) -> dict[str, Any]:
    return {name: getattr(step, name) if encode is None else encode(getattr(step, name))
            for name, encode in _STEP_ENCODERS}


def _decode(decoders: tuple[tuple[str, str, Any], ...], mapping: Any) -> dict[str, Any]:
    return {name: mapping[key] if decode is None else decode(mapping[key]) for name, key, decode in decoders}


def decoded_step(row: Any) -> dict[str, Any]:
    """A steps row (Core Row) as a dict of STEP_COLUMNS with ids and log-probs decoded to lists."""
    return _decode(_STEP_DECODERS, row._mapping)


def decoded_step_row(row: Any) -> dict[str, Any]:
    """A steps row joined with its trajectory's ROW_TRAJECTORY_FIELDS (labelled ``traj_<name>``): the step's
    columns then the trajectory's, decoded."""
    mapping = row._mapping
    return {**_decode(_STEP_DECODERS, mapping), **_decode(_ROW_DECODERS, mapping)}


def decoded_trajectory_row(row: Any) -> dict[str, Any]:
    """A trajectories row (Core Row with at least TRAJECTORY_COLUMNS) as a dict of TRAJECTORY_COLUMNS, decoded."""
    return _decode(_TRAJECTORY_DECODERS, row._mapping)


def decoded_trajectory(row: Any, steps: list[StepRecord]) -> TrajectoryRecord:
    return TrajectoryRecord(**decoded_trajectory_row(row), steps=steps)


# ------------------------------------------------------------------------------------------------- engine

SQLITE_SYNCHRONOUS = ("FULL", "NORMAL")
"""FULL: every commit is fsynced (survives power loss; ~3-4 ms a commit on an ordinary disk). NORMAL: WAL commits
reach the OS before the call returns, so they survive the process being killed (kill -9) but not a power loss;
~5x faster writes."""


def _switch_to_wal(cursor: sqlite3.Cursor, timeout_s: float) -> None:
    """``PRAGMA journal_mode=WAL``, retried until ``timeout_s``: while another connection switches the same file
    (several processes opening a fresh or older pool at once), SQLite answers "database is locked" at once instead
    of calling the busy handler, so the wait has to be ours."""
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) and "busy" not in str(err) or time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


def _sqlite_pragmas(busy_timeout_ms: int, synchronous: str):
    def on_connect(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        # first: switching the journal mode below needs the lock too, and must wait for it like any writer (a pool
        # being created or migrated by another process holds it), not fail after the driver's default 5 s
        cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
        _switch_to_wal(cursor, busy_timeout_ms / 1000)  # readers never block the writer
        cursor.execute(f"PRAGMA synchronous={synchronous}")
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
