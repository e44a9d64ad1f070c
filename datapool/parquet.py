"""Parquet export of a round's step table: the versioned dataset DVC tracks between rollout and train.

The schema is explicit and derived from the record declarations (datapool.records.STEP_ROW_FIELDS; token ids as
list<int32>, log-probs as list<float32>, see ARROW_TYPES), the dataset's own metadata (round,
policy versions, layout version) travels as JSON under the key ``arlflow`` in the Parquet schema metadata, and the
file is written to a temporary name and renamed, so a crash never leaves a half-written file at ``path``.
Files of an older layout still read: columns added since are filled with their defaults (ADDED_COLUMNS).
``import_steps`` loads such a file back into a data pool (idempotent on trajectory id).
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from datapool.records import ROW_TRAJECTORY_FIELDS, STEP_FIELDS, STEP_ROW_FIELDS, StepRecord, TrajectoryRecord
from datapool.schema import to_python

if TYPE_CHECKING:  # the store imports this module; import_steps only calls the pool it is given
    from datapool.store import DataPool

STEPS_SCHEMA_VERSION = 8
"""Version of STEPS_SCHEMA; files written with a newer one are refused, older ones read (see ADDED_COLUMNS).
5: plain_prompt_ids, macro_prompt_ids, macro_action_ids (the skill trace) and every column non-nullable; 6:
action_choices; 7: prefix_break; 8: staleness."""

METADATA_KEY = b"arlflow"

ARROW_TYPES: dict[str, pa.DataType] = {
    "ids": pa.list_(pa.int32()), "logprobs": pa.list_(pa.float32()), "id_lists": pa.list_(pa.list_(pa.int32())),
    "text": pa.string(), "str": pa.string(), "int": pa.int32(), "float": pa.float64(), "bool": pa.bool_(),
    "strs": pa.list_(pa.string()),
}
"""schema kind -> Arrow type, for every kind a step row holds (trajectory metadata, kind json, is not exported)."""

STEPS_SCHEMA = pa.schema([pa.field(f.name, ARROW_TYPES[f.kind], nullable=f.nullable) for f in STEP_ROW_FIELDS])
"""One row per step (datapool.records.STEP_ROW_FIELDS): the StepRecord fields, the trajectory fields declared
``on_step_rows``, ``excluded`` (curation excluded the step or its trajectory) and ``shaping`` (the total reward
adjustment the ``datapool.filters`` made to the step's trajectory; ``episode_return - shaping`` is the env's
return). The columns of ``DataPool.steps_frame`` plus ``shaping``."""

ADDED_COLUMNS: dict[str, Any] = {f.name: f.default for f in STEP_ROW_FIELDS if f.since > 1}
"""Columns added after layout version 1, with the value a frame or an older file without them gets (the field's
declared default): no recorded tool calls, no shaping (the pool's own frames carry no ``shaping``: stored rewards
are the env's), no process reward, the engine's own ids, nothing excluded, no skill trace."""

_newest = max(f.since for f in STEP_ROW_FIELDS)
if _newest > STEPS_SCHEMA_VERSION:
    raise RuntimeError(f"a step row field is declared since version {_newest} but STEPS_SCHEMA_VERSION is "
                       f"{STEPS_SCHEMA_VERSION}: bump datapool.parquet.STEPS_SCHEMA_VERSION")

_LIST_COLUMNS = tuple(f.name for f in STEPS_SCHEMA if pa.types.is_list(f.type))


class StepsFileError(ValueError):
    """A steps Parquet file is missing, corrupt, or not an arlflow steps file."""


def export_steps(df: pd.DataFrame, path: str | Path, *, metadata: dict[str, Any]) -> Path:
    """Write ``df`` (exactly the STEPS_SCHEMA columns; ADDED_COLUMNS may be absent and get their defaults) to
    ``path`` atomically; ``metadata`` must be JSON-able. ``df`` itself is never modified.

    ``schema_version`` and ``num_rows`` are added to the stored metadata.
    """
    path = Path(path)
    df = _with_added_columns(df)
    missing = [name for name in STEPS_SCHEMA.names if name not in df.columns]
    unknown = [name for name in df.columns if name not in STEPS_SCHEMA.names]
    if missing or unknown:
        raise ValueError(f"cannot export steps to {path}: missing columns {missing}, unknown columns {unknown}; "
                         f"the schema is datapool.parquet.STEPS_SCHEMA")
    stored = {**metadata, "schema_version": STEPS_SCHEMA_VERSION, "num_rows": len(df)}
    try:
        meta_json = json.dumps(stored, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot export steps to {path}: metadata is not JSON-serializable ({exc})") from None
    try:
        table = pa.Table.from_pandas(df[STEPS_SCHEMA.names], schema=STEPS_SCHEMA, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError, TypeError) as exc:  # ValueError: a null in a column
        raise ValueError(f"cannot export steps to {path}: a column does not fit STEPS_SCHEMA ({exc})") from None
    table = table.replace_schema_metadata({METADATA_KEY: meta_json.encode("utf-8")})

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(table, tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)  # atomic on POSIX and Windows: readers see the old file or the new, never half
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_steps(path: str | Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Read a file written by ``export_steps``: (steps frame with list columns as Python lists, metadata)."""
    path = Path(path)
    if not path.is_file():
        raise StepsFileError(f"steps file {path} missing: export the round first (DataPool.export_round)")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise StepsFileError(f"steps file {path} is corrupt or not Parquet ({exc}): re-export the round") from None
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise StepsFileError(f"steps file {path} has no '{METADATA_KEY.decode()}' metadata: not an arlflow steps file")
    try:
        metadata = json.loads(raw)
    except ValueError as exc:
        raise StepsFileError(f"steps file {path} has unreadable metadata ({exc})") from None
    version = metadata.get("schema_version")
    if not isinstance(version, int) or version > STEPS_SCHEMA_VERSION:
        raise StepsFileError(f"steps file {path} has schema version {version!r}; this arlflow reads "
                             f"<= {STEPS_SCHEMA_VERSION}: upgrade arlflow")
    try:  # columns an older layout typed differently (round was int64) read as today's type
        for position, name in enumerate(table.column_names):
            if name in STEPS_SCHEMA.names and table.schema.field(position).type != STEPS_SCHEMA.field(name).type:
                table = table.set_column(position, STEPS_SCHEMA.field(name),
                                         table.column(position).cast(STEPS_SCHEMA.field(name).type))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise StepsFileError(f"steps file {path} has a column that does not fit STEPS_SCHEMA ({exc})") from None
    df = table.to_pandas()
    for name in _LIST_COLUMNS:
        if name in df.columns:
            df[name] = pd.Series(table.column(name).to_pylist(), index=df.index, dtype=object)
    return _with_added_columns(df), metadata


def _with_added_columns(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with every absent ADDED_COLUMNS column (and every missing value in one) filled with its default, in
    STEPS_SCHEMA order (a new frame when anything was filled; ``df`` itself otherwise)."""
    absent = [name for name in ADDED_COLUMNS if name not in df.columns]
    holey = [name for name in ADDED_COLUMNS if name in df.columns and df[name].isna().any()]
    if not absent and not holey:
        return df
    df = df.copy()
    for name in absent + holey:
        default = ADDED_COLUMNS[name]
        if isinstance(default, list):  # one fresh (empty) list per row
            old = df[name] if name in holey else pd.Series([None] * len(df), index=df.index, dtype=object)
            df[name] = pd.Series([list(default) if _is_missing(value) else value for value in old],
                                 index=df.index, dtype=object)
            continue
        column = df[name].where(df[name].notna(), default) if name in holey else [default] * len(df)
        # through Arrow, so the dtype is what reading the column from a file gives (e.g. pandas' str for text)
        values = pa.array(list(column), type=STEPS_SCHEMA.field(name).type).to_pandas()
        df[name] = pd.Series(values.to_numpy() if len(df) else values, index=df.index, dtype=values.dtype)
    order = [name for name in STEPS_SCHEMA.names if name in df.columns]
    return df[order + [name for name in df.columns if name not in STEPS_SCHEMA.names]]


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)  # None or NaN (a list is never missing)


def _step_record(row: dict[str, Any]) -> StepRecord:
    """A StepRecord from one row of ``read_steps`` (numpy scalars and arrays become plain Python values)."""
    return StepRecord(**{f.name: to_python(f, row[f.name]) for f in STEP_FIELDS})


def import_steps(path: str | Path, pool: DataPool) -> int:
    """Load a steps file (``export_steps``, any layout version) into ``pool``; return how many trajectories were
    new. Idempotent: trajectories already in the pool are skipped. Rows flagged ``excluded`` are excluded in the
    pool's curation (for new trajectories only; curation done in the pool since is kept).

    A file holds steps, so each trajectory is rebuilt from its rows: its fields from the first row,
    num_steps/response_tokens from the rows, ``episode_return - shaping`` (the env's return) as its return, the
    scenario unknown ("{}") and ``metadata = {"imported_from": <file name>}``.
    """
    df, _ = read_steps(path)
    trajectories: list[TrajectoryRecord] = []
    excluded: dict[str, list[int]] = {}
    for tid, rows in df.sort_values(["trajectory_id", "step_index"]).groupby("trajectory_id", sort=True):
        records = rows.to_dict("records")
        first = records[0]
        steps = [_step_record(row) for row in records]
        fields = {f.name: to_python(f, first[f.name]) for f in ROW_TRAJECTORY_FIELDS}
        fields["episode_return"] -= float(first["shaping"])
        trajectories.append(TrajectoryRecord(
            **fields, trajectory_id=str(tid), group_id=steps[0].group_id, scenario="{}",
            policy_version=steps[0].policy_version, num_steps=len(steps),
            response_tokens=sum(len(s.response_ids) for s in steps), metadata={"imported_from": Path(path).name},
            steps=steps))
        marked = [int(row["step_index"]) for row in records if row["excluded"]]
        if marked:
            excluded[str(tid)] = marked
    already = set()
    for tid in excluded:
        try:
            pool.curation_of(tid)  # KeyError when the trajectory is not in the pool yet
            already.add(tid)
        except KeyError:
            pass
    added = pool.add_trajectories(trajectories)
    for tid, indices in excluded.items():
        if tid not in already:
            for index in indices:
                pool.curate(tid, step_index=index, excluded=True, note=f"excluded in {Path(path).name}")
    return added
