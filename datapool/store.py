"""The durable data pool: every trajectory and step of every round, in SQLite (WAL) or PostgreSQL.

One class, ``DataPool(url)``, on SQLAlchemy 2 (tables in ``datapool.tables``). Two ways in: the rollout stage
stores finished trajectories in batches (``add_trajectories``); the gateway opens a trajectory and appends its steps
one by one as requests are answered (``open_trajectory``, ``append_step``, ``set_reward``, ``finish_trajectory``).
Every write is validated first and happens in one transaction that has committed when the method returns, so bad
input never leaves a partial record and an acknowledged step survives a crash. Curation (labels, exclusions) and
queries live in ``datapool.curation``, the read side (records, frames, Parquet export) in ``datapool.reads``; the
methods here delegate to them.

Concurrency: SQLite write transactions start with ``BEGIN IMMEDIATE`` (take the write lock up front and wait for it
up to the busy timeout, instead of failing when a read snapshot goes stale); PostgreSQL writes lock the trajectory's
row (``SELECT ... FOR UPDATE``) and a transaction that loses a race on a unique key is retried.
"""
from __future__ import annotations

import json
import re
import os
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
from sqlalchemy import func, insert, inspect, select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from datapool import curation, reads
from datapool.records import (FINAL_STATUSES, StepRecord, TrajectoryRecord, is_int, is_real, validate_step,
                              validate_trajectory)
from datapool.tables import (MIGRATIONS, SCHEMA_VERSION, SQLITE_SYNCHRONOUS, STEP_COLUMNS, STEPS, TRAJECTORIES, Base,
                             RequestRow, SchemaVersionError, SchemaVersionRow, decode_ids, decode_logprobs, encode_ids,
                             encode_logprobs, make_engine, step_row, trajectory_row)
from datapool.writability import (FULL, PoolUnwritableError, open_hint, space_problem, sqlite_file,
                                  unwritable_kind, unwritable_message)

__all__ = ["DataPool", "MIGRATIONS", "PoolUnwritableError", "SCHEMA_VERSION", "SQLITE_SYNCHRONOUS", "STEP_COLUMNS",
           "SchemaVersionError", "TRAJECTORY_COLUMNS", "decode_ids", "decode_logprobs", "encode_ids", "encode_logprobs",
           "validate_trajectory"]

_ID_CHUNK = 500  # ids per IN (...) query: well under every backend's bound-parameter limit
_RETRIES = 8     # attempts of a write that lost a race on a unique key (PostgreSQL)
_SCHEMA_LOCK_KEY = 724_001  # PostgreSQL advisory lock that serializes schema creation and migration

TRAJECTORY_COLUMNS: tuple[str, ...] = curation.TRAJECTORY_COLUMNS


T = TRAJECTORIES
S = STEPS
R = RequestRow.__table__




class PoolOpenError(ValueError):
    """The pool's URL or file cannot be opened (bad URL, not a database, server down): one line says why."""


def _first_line(err: BaseException) -> str:
    text = str(getattr(err, "orig", None) or err).strip().splitlines()
    return text[0] if text else type(err).__name__


def masked_url(url: str) -> str:
    """The URL without its password (a pool URL may carry one; errors end up in logs)."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", str(url))

class TrajectoryClosedError(ValueError):
    """A change that needs an open trajectory was asked of a finished one (the gateway answers 409)."""

class StepConflictError(ValueError):
    """append_step(expected_index=k) found another step index next: a concurrent writer appended first."""

def _open_record(trajectory_id: str, *, group_id: str, policy_version: str, env: str = "gateway", split: str = "train",
                 round: int = 0, scenario: str = "{}", metadata: dict | None = None) -> TrajectoryRecord:
    """The validated record of a just-opened trajectory: status "open", no steps, return 0.0."""
    record = TrajectoryRecord(trajectory_id=trajectory_id, group_id=group_id, scenario=scenario, env=env,
                              split=split, round=round, policy_version=policy_version, status="open",
                              episode_return=0.0, won=False, num_steps=0, response_tokens=0,
                              metadata={} if metadata is None else metadata)
    validate_trajectory(record)
    return record


class DataPool:
    """Trajectories and steps of every round. ``url``: a SQLAlchemy URL (``sqlite:///data/pool.db``,
    ``postgresql+psycopg://...``) or a bare file path (SQLite). Use as a context manager or call ``close()``.
    Thread-safe: one instance may be shared by many threads, and many instances (processes) may share a pool.

    ``busy_timeout_s``: how long a SQLite writer waits for the write lock. ``sqlite_synchronous``: "FULL" (default,
    fsync per commit) or "NORMAL" (survives kill -9, not power loss); see SQLITE_SYNCHRONOUS."""

    def __init__(self, url: str, *, busy_timeout_s: float = 30.0, sqlite_synchronous: str = "FULL") -> None:
        if sqlite_synchronous not in SQLITE_SYNCHRONOUS:
            raise ValueError(f"field 'sqlite_synchronous' is {sqlite_synchronous!r}; use one of "
                             f"{', '.join(SQLITE_SYNCHRONOUS)}")
        self.url = url
        self.write_problem: str | None = None
        """Why the last write failed for lack of space or permission (PoolUnwritableError's message); cleared
        only by ``check_writable``, so a small write that still fits does not hide a full disk."""
        try:
            self.engine = make_engine(url, busy_timeout_s, sqlite_synchronous)
        except (SQLAlchemyError, ImportError) as err:
            raise PoolOpenError(f"cannot open the data pool {masked_url(url)}: {_first_line(err)}: use a SQLite path "
                                "or a sqlite:/// or postgresql+psycopg:// URL") from err
        except OSError as err:  # its folder cannot be created (a file in the way, a read-only mount)
            why = "a file is in the way" if isinstance(err, (FileExistsError, NotADirectoryError)) else err.strerror
            raise PoolOpenError(f"cannot open the data pool {masked_url(url)}: cannot create its folder "
                                f"{err.filename}: {why}: use a path whose folders exist or can be created by this "
                                "process") from err
        self._sqlite = self.engine.dialect.name == "sqlite"
        self._file = sqlite_file(self.engine.url)
        try:
            self._open_schema()
        except PoolUnwritableError as err:  # creating or migrating the tables needs a write
            self.engine.dispose()
            raise PoolOpenError(str(err)) from err
        except SQLAlchemyError as err:
            self.engine.dispose()
            raise PoolOpenError(f"cannot open the data pool {masked_url(url)}: {_first_line(err)}: "
                                f"{open_hint(self._file)}") from err
        except BaseException:
            self.engine.dispose()
            raise

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        """One write transaction, committed on exit: it holds SQLite's write lock from its first statement.
        A write refused for lack of space or permission is rolled back and raised as PoolUnwritableError."""
        try:
            with self.engine.begin() as conn:
                if self._sqlite:
                    # pysqlite opens transactions lazily (and DEFERRED); take the write lock now so no read snapshot
                    # can go stale before our write
                    conn.exec_driver_sql("BEGIN IMMEDIATE")
                yield conn
        except (SQLAlchemyError, OSError) as err:
            kind = unwritable_kind(err, self._file)
            if kind is None:
                raise
            self.write_problem = unwritable_message(kind, masked_url(self.url), _first_line(err), self._file)
            raise PoolUnwritableError(self.write_problem) from err

    def _open_schema(self) -> None:
        """Create the tables, or migrate older ones to SCHEMA_VERSION, in one transaction: all steps or none.

        Concurrent openers are serialized (SQLite's write lock, a PostgreSQL advisory lock), so a pool is created
        or migrated exactly once."""
        with self._write() as conn:
            if not self._sqlite:
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
            found = None
            if inspect(conn).has_table(SchemaVersionRow.__tablename__):
                found = conn.scalar(select(SchemaVersionRow.version).where(SchemaVersionRow.id == 1))
            if found is not None and found > SCHEMA_VERSION:
                raise SchemaVersionError(f"data pool {self.url} has schema version {found}, this arlflow reads "
                                         f"version {SCHEMA_VERSION}: upgrade arlflow to open it")
            if found is not None and found < SCHEMA_VERSION:
                missing = [v for v in range(found, SCHEMA_VERSION) if v not in MIGRATIONS]
                if missing:
                    raise SchemaVersionError(f"data pool {self.url} has schema version {found} and arlflow has no "
                                             f"migration from version(s) {missing}: start a fresh pool")
                for version in range(found, SCHEMA_VERSION):
                    MIGRATIONS[version](conn)
                conn.execute(text("UPDATE schema_version SET version = :v WHERE id = 1"), {"v": SCHEMA_VERSION})
            Base.metadata.create_all(conn)  # checkfirst: creates only what is missing (new tables of a migration)
            if found is None:
                conn.execute(insert(SchemaVersionRow.__table__), {"id": 1, "version": SCHEMA_VERSION})

    # -- writing: batches of finished trajectories (the rollout stage)

    def add_trajectories(self, trajs: list[TrajectoryRecord]) -> int:
        """Store ``trajs`` and their steps in one transaction; return how many were new.

        Idempotent on trajectory_id: ids already in the pool are skipped (counted as 0). Every record is
        validated first; if any is invalid, ValueError names it and its field and nothing is written.
        """
        seen: set[str] = set()
        for traj in trajs:
            validate_trajectory(traj)
            if traj.trajectory_id in seen:
                raise ValueError(f"invalid trajectory {traj.trajectory_id!r}: field 'trajectory_id' appears twice "
                                 f"in this batch; nothing was written")
            seen.add(traj.trajectory_id)
        if not trajs:
            return 0
        for attempt in range(_RETRIES):
            try:
                return self._insert_new(trajs)
            except IntegrityError:
                # a concurrent writer added some of these ids between our check and insert: check again
                if attempt == _RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _insert_new(self, trajs: list[TrajectoryRecord]) -> int:
        ids = [t.trajectory_id for t in trajs]
        now = time.time()
        with self._write() as conn:
            existing: set[str] = set()
            for start in range(0, len(ids), _ID_CHUNK):
                chunk = ids[start:start + _ID_CHUNK]
                existing.update(conn.scalars(select(T.c.trajectory_id).where(T.c.trajectory_id.in_(chunk))))
            new = [t for t in trajs if t.trajectory_id not in existing]
            if not new:
                return 0
            conn.execute(insert(T), [trajectory_row(t, now) for t in new])
            step_rows = [step_row(s) for t in new for s in t.steps]
            if step_rows:
                conn.execute(insert(S), step_rows)
        return len(new)

    # -- writing: one step at a time (the gateway)

    def open_trajectory(self, trajectory_id: str, *, group_id: str, policy_version: str, env: str = "gateway",
                        split: str = "train", round: int = 0, scenario: str = "{}",
                        metadata: dict | None = None) -> bool:
        """Create trajectory ``trajectory_id`` with status "open", no steps and return 0.0; False (and nothing
        changed) if it already exists."""
        record = _open_record(trajectory_id, group_id=group_id, policy_version=policy_version, env=env, split=split,
                              round=round, scenario=scenario, metadata=metadata)
        try:
            with self._write() as conn:
                if conn.scalar(select(T.c.trajectory_id).where(T.c.trajectory_id == trajectory_id)) is not None:
                    return False
                conn.execute(insert(T), trajectory_row(record, time.time()))
        except IntegrityError:  # PostgreSQL: a concurrent open of the same id won
            return False
        return True

    def append_step(self, step: StepRecord, *, idempotency_key: str | None = None, response: dict | None = None,
                    expected_index: int | None = None, open_as: dict | None = None) -> tuple[int, dict | None]:
        """Append ``step`` to its (open) trajectory in one transaction; return (step_index, None).

        The pool assigns ``step.step_index`` (the trajectory's next index; the given one is ignored) and adds the
        step to the trajectory's num_steps, response_tokens and episode_return. With ``idempotency_key``, the key
        and ``response`` (what the gateway answers) are stored in the same transaction; a key seen before writes
        nothing and returns (its stored step_index, its stored response). With ``expected_index``, a trajectory whose
        next index is another one (a concurrent append) raises StepConflictError and nothing is written. With
        ``open_as`` (open_trajectory's keyword arguments but group_id, which is the step's), a trajectory that does not
        exist yet is opened in the same transaction: a failed append leaves no empty trajectory behind.
        """
        if idempotency_key is not None and (not isinstance(idempotency_key, str) or not idempotency_key):
            raise ValueError(f"field 'idempotency_key' must be a non-empty str or None, got {idempotency_key!r}")
        if response is not None:
            try:
                if not isinstance(response, dict):
                    raise TypeError(f"got {type(response).__name__}")
                json.dumps(response, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"field 'response' must be a JSON-serializable dict or None ({exc})") from None
        if not isinstance(step, StepRecord):
            raise ValueError(f"field 'step' must be a StepRecord, got {type(step).__name__}")
        if not isinstance(step.trajectory_id, str) or not step.trajectory_id:
            raise ValueError(f"field 'trajectory_id' must be a non-empty str, got {step.trajectory_id!r}")
        opening = None if open_as is None else _open_record(step.trajectory_id, group_id=step.group_id, **open_as)
        for attempt in range(_RETRIES):
            try:
                with self._write() as conn:
                    if opening is not None and conn.scalar(
                            select(T.c.trajectory_id).where(T.c.trajectory_id == opening.trajectory_id)) is None:
                        conn.execute(insert(T), trajectory_row(opening, time.time()))
                    return self._append(conn, step, idempotency_key, response, expected_index)
            except IntegrityError:
                # PostgreSQL: the same idempotency key was stored for another trajectory at the same moment; the
                # next attempt finds it
                if attempt == _RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _stored_request(self, conn: Connection, key: str | None) -> tuple[int, dict | None] | None:
        if key is None:
            return None
        found = conn.execute(select(R.c.step_index, R.c.response).where(R.c.idempotency_key == key)).first()
        return None if found is None else (found.step_index, found.response)

    def _append(self, conn: Connection, step: StepRecord, key: str | None, response: dict | None,
                expected_index: int | None = None) -> tuple[int, dict | None]:
        tid = step.trajectory_id
        stored = self._stored_request(conn, key)
        if stored is not None:
            return stored
        traj = self._lock_trajectory(conn, tid)
        if not self._sqlite:  # a concurrent retry may have committed while we waited for the row lock
            stored = self._stored_request(conn, key)
            if stored is not None:
                return stored
        if traj.status != "open":
            raise ValueError(f"cannot append to trajectory {tid!r}: field 'status' is {traj.status!r}, steps are "
                             f"appended only while it is 'open' (open_trajectory); nothing was written")
        validate_step(tid, traj.group_id, step, check_index=False)
        last = conn.scalar(select(func.max(S.c.step_index)).where(S.c.trajectory_id == tid))
        index = 0 if last is None else last + 1
        if expected_index is not None and index != expected_index:
            raise StepConflictError(f"trajectory {tid!r} got step {index - 1} from another request while this one "
                                    f"was built on {expected_index} steps; nothing was written")
        step.step_index = index
        conn.execute(insert(S), step_row(step))
        conn.execute(update(T).where(T.c.trajectory_id == tid).values(
            num_steps=T.c.num_steps + 1, response_tokens=T.c.response_tokens + len(step.response_ids),
            episode_return=T.c.episode_return + float(step.reward)))
        if key is not None:
            conn.execute(insert(R), {"idempotency_key": key, "trajectory_id": tid, "step_index": index,
                                     "response": response, "created_at": time.time()})
        return index, None

    @staticmethod
    def _lock_trajectory(conn: Connection, trajectory_id: str) -> Any:
        """The trajectory's row, locked for this transaction (FOR UPDATE; SQLite already holds its write lock)."""
        row = conn.execute(select(T.c.group_id, T.c.status, T.c.created_at)
                           .where(T.c.trajectory_id == trajectory_id).with_for_update()).first()
        if row is None:
            raise KeyError(f"unknown trajectory {trajectory_id!r}")
        return row

    def lookup_request(self, idempotency_key: str) -> dict | None:
        """The response stored with ``idempotency_key`` by ``append_step``, or None."""
        with self.engine.connect() as conn:
            stored = self._stored_request(conn, idempotency_key)
        return None if stored is None else stored[1]

    def set_reward(self, trajectory_id: str, reward: float, *, step_index: int | None = None,
                   require_open: bool = False) -> None:
        """Set the reward of step ``step_index`` (default: the last step) and recompute the trajectory's
        episode_return as the sum of its step rewards. ``require_open``: refuse (TrajectoryClosedError) unless the
        trajectory is still open, checked under the row's lock (the gateway's rule)."""
        if not is_real(reward) or math.isnan(reward):
            raise ValueError(f"field 'reward' must be a real number, not NaN; got {reward!r}")
        if step_index is not None and (not is_int(step_index) or step_index < 0):
            raise ValueError(f"field 'step_index' must be an int >= 0 or None, got {step_index!r}")
        with self._write() as conn:
            row = self._lock_trajectory(conn, trajectory_id)
            if require_open and row.status != "open":
                raise TrajectoryClosedError(f"trajectory {trajectory_id!r} is already {row.status}: its rewards are "
                                            "final; start a new trajectory")
            where = S.c.trajectory_id == trajectory_id
            if step_index is None:
                step_index = conn.scalar(select(func.max(S.c.step_index)).where(where))
                if step_index is None:
                    raise ValueError(f"cannot set the reward of trajectory {trajectory_id!r}: it has no steps "
                                     f"(field 'step_index')")
            done = conn.execute(update(S).where(where, S.c.step_index == step_index).values(reward=float(reward)))
            if done.rowcount == 0:
                raise KeyError(f"unknown step {step_index} of trajectory {trajectory_id!r}")
            total = conn.scalar(select(func.sum(S.c.reward)).where(where))
            if total is None or not math.isfinite(float(total)):
                raise ValueError(f"field 'reward' {reward!r} would make trajectory {trajectory_id!r}'s return "
                                 f"{total!r}, not a finite number: send rewards on a bounded scale")
            conn.execute(update(T).where(T.c.trajectory_id == trajectory_id).values(episode_return=float(total)))

    def finish_trajectory(self, trajectory_id: str, *, status: str = "complete", won: bool | None = None,
                          require_open: bool = False) -> None:
        """Close a trajectory: set its final ``status`` (and ``won`` when given). Finishing an open trajectory also
        records its wall time since open_trajectory. Finishing again just updates status/won, unless
        ``require_open`` (the gateway's rule): then TrajectoryClosedError, checked under the row's lock."""
        if status not in FINAL_STATUSES:
            raise ValueError(f"field 'status' is {status!r}; a trajectory finishes as one of "
                             f"{', '.join(FINAL_STATUSES)}")
        if won is not None and not isinstance(won, bool):
            raise ValueError(f"field 'won' must be a bool or None, got {won!r}")
        with self._write() as conn:
            row = self._lock_trajectory(conn, trajectory_id)
            if require_open and row.status != "open":
                raise TrajectoryClosedError(f"trajectory {trajectory_id!r} is already {row.status}: it cannot be "
                                            "completed again")
            values: dict[str, Any] = {"status": status}
            if won is not None:
                values["won"] = won
            if row.status == "open" and row.created_at:
                values["wall_time_s"] = max(0.0, time.time() - row.created_at)
            conn.execute(update(T).where(T.c.trajectory_id == trajectory_id).values(**values))

    # -- curation (datapool.curation)

    def curate(self, trajectory_id: str, *, step_index: int | None = None, excluded: bool | None = None,
               label: str | None = None, note: str = "") -> None:
        """Label and/or exclude a trajectory (step_index None) or one of its steps; see ``curation.curate``."""
        with self._write() as conn:
            self._lock_trajectory(conn, trajectory_id)
            curation.curate(conn, trajectory_id, step_index=step_index, excluded=excluded, label=label, note=note)

    def curation_of(self, trajectory_id: str) -> dict:
        """{"trajectory": {excluded, label, note, updated_at} | None, "steps": {step_index: {...}}}."""
        with self.engine.connect() as conn:
            return curation.curation_of(conn, trajectory_id)

    def curation_frame(self, *, round: int | None = None) -> pd.DataFrame:
        """Every label and exclusion (of ``round``'s trajectories when given): curation.CURATION_FRAME_COLUMNS,
        step_index -1 for a whole trajectory, sorted, deterministic."""
        with self.engine.connect() as conn:
            rows = curation.curation_rows(conn, round=round)
        return pd.DataFrame(rows, columns=list(curation.CURATION_FRAME_COLUMNS)).astype(
            {"step_index": "int64", "excluded": "bool"})

    def query_trajectories(self, *, env: str | None = None, round: int | None = None,
                           policy_version: str | None = None, status: str | None = None,
                           min_return: float | None = None, max_return: float | None = None,
                           label: str | None = None, excluded: bool | None = None, flag: str | None = None,
                           limit: int = 100, offset: int = 0) -> list[dict]:
        """Trajectories matching every given filter, newest first; see ``curation.query_trajectories``."""
        with self.engine.connect() as conn:
            return curation.query_trajectories(
                conn, env=env, round=round, policy_version=policy_version, status=status, min_return=min_return,
                max_return=max_return, label=label, excluded=excluded, flag=flag, limit=limit, offset=offset)

    def stats(self) -> dict:
        """Counts by status/env/round, steps, exclusions, labels and retokenized steps."""
        with self.engine.connect() as conn:
            return curation.stats(conn)

    # -- reading (datapool.reads)

    def get_trajectory(self, trajectory_id: str) -> TrajectoryRecord:
        """The trajectory with its steps in order; KeyError if unknown."""
        with self.engine.connect() as conn:
            return reads.get_trajectory(conn, trajectory_id)

    def trajectories_frame(self, *, round: int | None = None, env: str | None = None,
                           split: str | None = None) -> pd.DataFrame:
        """One row per trajectory (all TrajectoryRecord fields but steps), ordered by round, group, id."""
        with self.engine.connect() as conn:
            return reads.trajectories_frame(conn, round=round, env=env, split=split)

    def steps_frame(self, *, round: int | None = None, env: str | None = None,
                    include_excluded: bool = True) -> pd.DataFrame:
        """One row per step, with its trajectory's round/env/split/status/won/episode_return joined on, and
        ``excluded`` (the step or its trajectory is excluded by curation; ``include_excluded=False`` drops those);
        see ``reads.steps_frame``."""
        with self.engine.connect() as conn:
            return reads.steps_frame(conn, round=round, env=env, include_excluded=include_excluded)

    def counts(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return reads.counts(conn)

    def export(self, path: str | Path, *, round: int | None = None, env: str | None = None,
               include_excluded: bool = True) -> int:
        """Write the matching steps to a Parquet file at ``path`` (see ``datapool.parquet``); return rows.

        The dataset metadata records the filters, policy versions, envs, trajectory count, excluded and
        retokenized row counts and the pool's schema version."""
        df = self.steps_frame(round=round, env=env, include_excluded=include_excluded)
        return reads.export_steps_frame(df, path, round=round, env=env, include_excluded=include_excluded)

    def export_round(self, round: int, path: str | Path) -> int:
        """Write the steps of ``round`` to a Parquet file at ``path`` (see ``datapool.parquet``); return rows."""
        return self.export(path, round=round)

    # -- health

    def integrity_problem(self) -> str | None:
        """What is wrong with the stored data, or None: SQLite's ``PRAGMA quick_check`` (reads every page, so a
        truncated or corrupted file is found before work that would write to it) and that the file is writable;
        other backends answer a trivial query."""
        try:
            with self.engine.connect() as conn:
                if not self._sqlite:
                    conn.execute(text("SELECT 1"))
                    return None
                result = [row[0] for row in conn.exec_driver_sql("PRAGMA quick_check").fetchall()]
        except Exception as err:  # noqa: BLE001 - the driver's own words are the diagnosis
            return f"{type(err).__name__}: {err}"
        if result != ["ok"]:
            return "; ".join(str(r) for r in result[:3])
        database = self.engine.url.database
        if database and database != ":memory:" and not os.access(database, os.W_OK):
            return f"{database} is not writable"
        return None

    def check_writable(self, *, min_free_bytes: int = 0) -> str | None:
        """Why the pool cannot take writes now, or None; kept in ``write_problem``. A real write transaction that
        changes nothing (an immutable or read-only file, a read-only mount, database or role fail it), and for a
        SQLite file its disk's free space (at least ``min_free_bytes``) and its page limit. Waits for the write
        lock like any writer; other errors (server down, lock timeout) are raised."""
        problem = space_problem(masked_url(self.url), self._file, min_free_bytes)
        if problem is None:
            try:
                with self._write() as conn:
                    conn.execute(text("UPDATE schema_version SET version = version WHERE id = 1"))
                    if self._sqlite:
                        used, limit, free = (conn.exec_driver_sql(f"PRAGMA {name}").scalar()
                                             for name in ("page_count", "max_page_count", "freelist_count"))
                        if used >= limit and not free:
                            problem = unwritable_message(FULL, masked_url(self.url), f"{used} pages, the "
                                                         "connection's max_page_count", self._file)
            except PoolUnwritableError as err:
                problem = str(err)
        self.write_problem = problem
        return problem

    # -- lifetime

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> DataPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
