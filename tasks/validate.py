"""validate: the great-expectations gate over the round's step table, published as GX Data Docs beside its JSON
report; then the pool's curation (exclusions, labels: the curate stage's snapshot), failed episodes left out
(validate.keep_failed), zero-variance groups dropped."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from datapool.curation import apply_curation, drop_failed
from datapool.parquet import export_steps, read_steps
from datapool.quality import STEPLESS, drop_zero_variance_groups, validate_steps, write_data_docs
from tasks.common import write_json
from tasks.config import Params
from tasks.curate import read_curation
from tasks.layout import Layout, require
from tasks.outputs import staged_outputs


class DataValidationError(RuntimeError):
    """The round's data failed the quality gate; the message is the readable report."""


def _docs_link(docs: Path, page: Path | None) -> str | None:
    """The Data Docs' result ``page`` (relative to the site) as the report beside the site ``docs`` links it."""
    return (Path(docs.name) / page).as_posix() if page else None


def run(params: Params, layout: Layout, round_index: int) -> dict[str, Any]:
    """The gate over steps.parquet. On success validated.parquet, the report, its Data Docs (``data_docs/``) and
    validate.json replace the old ones together; on failure they are left as they were, and the report and Data Docs
    of the failed run are written beside them (``validate_report.failed.json``, ``data_docs.failed/``, not pipeline
    outputs) and quoted in the error. The report's ``data_docs`` is the Data Docs' validation result page."""
    cfg = params.validate
    frame, metadata = read_steps(require(layout.steps(round_index), f"rollout_{round_index}"))
    snapshot = layout.curation(round_index)
    curation = read_curation(snapshot) if snapshot.exists() else None
    report = validate_steps(frame, cfg.limits(params.rollout.group_size), round=round_index,
                            stepless=metadata.get(STEPLESS))
    report_path = layout.round_metrics(round_index, "validate_report")
    failed_path = report_path.with_name(f"{report_path.stem}.failed.json")
    docs = layout.data_docs(round_index)
    failed_docs = docs.with_name(f"{docs.name}.failed")
    shutil.rmtree(failed_docs, ignore_errors=True)
    if not report.success:
        page = write_data_docs(report, failed_docs)
        write_json(failed_path, {**report.to_dict(), "data_docs": _docs_link(failed_docs, page)})
        raise DataValidationError(f"round {round_index} data failed validation (report: {failed_path}, Data Docs: "
                                  f"{failed_docs / page if page else 'none'}; earlier outputs left as they "
                                  f"were):\n{report.render()}")
    failed_path.unlink(missing_ok=True)
    steps_in = len(frame)
    # what the rollout wrote passed the gate; now the deliberate removals: curation, then failed episodes
    frame, curated = apply_curation(frame, curation)
    failed = {"failed_trajectories": 0, "failed_steps": 0}
    if not cfg.keep_failed:
        frame, failed = drop_failed(frame)
    kept, stats = (drop_zero_variance_groups(frame) if cfg.drop_zero_variance
                   else (frame, {"groups_total": int(frame["group_id"].nunique()), "groups_dropped": 0,
                                 "steps_dropped": 0}))
    metrics = {"round": round_index, "steps_in": steps_in, "steps_out": len(kept),
               "expectations": len(report.results), **stats, **curated, **failed,
               "failed_kept": bool(cfg.keep_failed), "curation_snapshot": snapshot.exists(),
               "failed_before_first_step": sum((metadata.get(STEPLESS) or {}).values())}  # no rows to drop
    outputs = [layout.validated(round_index), report_path, layout.round_metrics(round_index, "validate"), docs]
    with staged_outputs(layout.root, f"validate_{round_index}", outputs) as out:
        export_steps(kept, out.path(outputs[0]), metadata={**metadata, "validated": True, **stats})
        page = write_data_docs(report, out.path(docs))
        write_json(out.path(report_path), {**report.to_dict(), "curation": curated, "failed": failed,
                                           "data_docs": _docs_link(docs, page)})
        write_json(out.path(outputs[2]), metrics)
    return metrics
