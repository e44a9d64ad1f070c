"""Parquet export of a round's step table: the versioned dataset DVC tracks between rollout and train.

The schema is explicit (token ids as list<int32>, log-probs as list<float32>), the dataset's own metadata (round,
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

from datapool.records import StepRecord, TrajectoryRecord

if TYPE_CHECKING:  # the store imports this module; import_steps only calls the pool it is given
    from datapool.store import DataPool

STEPS_SCHEMA_VERSION = 4
"""Version of STEPS_SCHEMA; files written with a newer one are refused, older ones read (see ADDED_COLUMNS)."""

METADATA_KEY = b"arlflow"

STEPS_SCHEMA = pa.schema([
    pa.field("trajectory_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("step_index", pa.int32(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("prompt_text", pa.string()),
    pa.field("observation", pa.string()),
    pa.field("action", pa.string()),
    pa.field("response_text", pa.string()),
    pa.field("reward", pa.float64()),
    pa.field("anchor", pa.string()),
    pa.field("policy_version", pa.string()),
    pa.field("action_valid", pa.bool_()),
    pa.field("truncated", pa.bool_()),
    pa.field("skill_ids", pa.list_(pa.string())),
    pa.field("context_manager", pa.string()),
    pa.field("tool_calls", pa.int32()),
    pa.field("tool_successes", pa.int32()),
    pa.field("process_reward", pa.float64()),
    pa.field("retokenized", pa.bool_()),
    pa.field("round", pa.int64()),
    pa.field("env", pa.string()),
    pa.field("split", pa.string()),
    pa.field("status", pa.string()),
    pa.field("won", pa.bool_()),
    pa.field("episode_return", pa.float64()),
    pa.field("excluded", pa.bool_()),
    pa.field("shaping", pa.float64()),
])
"""One row per step: the columns of ``DataPool.steps_frame`` (``retokenized``: the ids were re-derived from text;
``excluded``: curation excluded the step or its trajectory), plus ``shaping`` (the total reward adjustment the
``datapool.filters`` made to the step's trajectory; ``episode_return - shaping`` is the return the env gave)."""

ADDED_COLUMNS: dict[str, int | float | bool] = {
    "tool_calls": 0, "tool_successes": 0, "shaping": 0.0, "process_reward": 0.0, "retokenized": False,
    "excluded": False,
}
"""Columns added in layout versions 2 (tool counts, shaping), 3 (process_reward) and 4 (retokenized, excluded), with
the value a frame or an older file without them gets: no recorded tool calls, no shaping (the pool's own frames
carry no ``shaping``: stored rewards are the env's), the engine's own ids, nothing excluded."""

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
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
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
        dtype = STEPS_SCHEMA.field(name).type.to_pandas_dtype()
        column = df[name].where(df[name].notna(), ADDED_COLUMNS[name]) if name in holey else ADDED_COLUMNS[name]
        df[name] = pd.Series(column, index=df.index).astype(dtype)
    order = [name for name in STEPS_SCHEMA.names if name in df.columns]
    return df[order + [name for name in df.columns if name not in STEPS_SCHEMA.names]]


_STEP_FIELDS = ("trajectory_id", "group_id", "step_index", "prompt_text", "observation", "action", "response_text",
                "anchor", "policy_version", "context_manager")


def _step_record(row: dict[str, Any]) -> StepRecord:
    fields = {name: row[name] for name in _STEP_FIELDS}
    fields["step_index"] = int(row["step_index"])
    return StepRecord(
        **fields, prompt_ids=[int(i) for i in row["prompt_ids"]], response_ids=[int(i) for i in row["response_ids"]],
        logprobs=[float(x) for x in row["logprobs"]], reward=float(row["reward"]),
        action_valid=bool(row["action_valid"]), truncated=bool(row["truncated"]),
        skill_ids=list(row["skill_ids"]), tool_calls=int(row["tool_calls"]), tool_successes=int(row["tool_successes"]),
        process_reward=float(row["process_reward"]), retokenized=bool(row["retokenized"]))


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
        trajectories.append(TrajectoryRecord(
            trajectory_id=str(tid), group_id=first["group_id"], scenario="{}", env=first["env"], split=first["split"],
            round=int(first["round"]), policy_version=first["policy_version"], status=first["status"],
            episode_return=float(first["episode_return"]) - float(first["shaping"]), won=bool(first["won"]),
            num_steps=len(steps), response_tokens=sum(len(s.response_ids) for s in steps),
            metadata={"imported_from": Path(path).name}, steps=steps))
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
