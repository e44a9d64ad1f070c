"""curate: snapshot the data pool's labels and exclusions (made in the gateway UI or with `arlflow pool curate`)
into one file per round, so that curation is part of the lineage: validate_r depends on its round's file, and a
label or exclusion made after the rollout marks validate_r (and what follows) stale, and nothing else.

The pool lives outside DVC, so the stage is ``always_changed`` in dvc.yaml: it runs on every `dvc repro` /
`arlflow pipeline` (a query, about a second), and its files change only when the curation changed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pandas as pd
from sqlalchemy.engine import make_url

from datapool.curation import CURATION_FRAME_COLUMNS
from datapool.store import DataPool
from datapool.writability import sqlite_file
from tasks.common import write_json
from tasks.config import Params
from tasks.layout import Layout, stage_pool_url
from tasks.outputs import staged_outputs

CURATION_SCHEMA = pa.schema([pa.field("trajectory_id", pa.string()), pa.field("step_index", pa.int64()),
                             pa.field("excluded", pa.bool_()), pa.field("label", pa.string()),
                             pa.field("note", pa.string())])
assert tuple(CURATION_SCHEMA.names) == CURATION_FRAME_COLUMNS


def pool_url(params: Params, layout: Layout) -> str:
    """The pool this run reads curation from: rollout.pool_url, the workspace's, or its experiment's
    (tasks.layout.stage_pool_url)."""
    return stage_pool_url(layout, params.rollout.pool_url, writes=False)


def write_curation(frame: pd.DataFrame, path: Path) -> Path:
    """A curation snapshot, byte-for-byte the same for the same rows (no timestamps in the file)."""
    table = pa.Table.from_pandas(frame[list(CURATION_FRAME_COLUMNS)], schema=CURATION_SCHEMA, preserve_index=False)
    pq.write_table(table.replace_schema_metadata(None), path)
    return path


def read_curation(path: Path) -> pd.DataFrame:
    """A snapshot written by the curate stage; an empty frame when there is none (curation never ran)."""
    if not path.exists():
        return pd.DataFrame(columns=list(CURATION_FRAME_COLUMNS))
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path} is not a readable curation snapshot ({err}): rerun `dvc repro curate`") from err
    missing = sorted(set(CURATION_FRAME_COLUMNS) - set(table.column_names))
    if missing:
        raise ValueError(f"{path} lacks columns {missing}: rerun `dvc repro curate`")
    return table.to_pandas()


def run(params: Params, layout: Layout) -> dict[str, Any]:
    url = pool_url(params, layout)
    rounds = range(1, params.pipeline.rounds + 1)
    file = sqlite_file(make_url(url))
    frames: dict[int, pd.DataFrame] = {}
    if file is not None and not file.exists():  # no rollout yet: nothing curated (no pool created)
        frames = {r: pd.DataFrame(columns=list(CURATION_FRAME_COLUMNS)) for r in rounds}
    else:
        with DataPool(url) as pool:
            frames = {r: pool.curation_frame(round=r) for r in rounds}
    metrics = {f"round_{r}": {"excluded_trajectories": int(((f["step_index"] == -1) & f["excluded"]).sum()),
                              "excluded_steps": int(((f["step_index"] >= 0) & f["excluded"]).sum()),
                              "labelled": int((f["label"] != "").sum())} for r, f in frames.items()}
    outputs = [layout.curation(r) for r in rounds] + [layout.metrics_dir / "curate.json"]
    with staged_outputs(layout.root, "curate", outputs) as out:
        for r, frame in frames.items():
            write_curation(frame.astype({"excluded": bool}), out.path(layout.curation(r)))
        write_json(out.path(outputs[-1]), metrics)
    return metrics
