"""validate: the great-expectations gate over the round's step table, then the RL data filters."""
from __future__ import annotations

from typing import Any

from datapool.parquet import export_steps, read_steps
from datapool.quality import QualityLimits, drop_zero_variance_groups, validate_steps
from tasks.common import write_json
from tasks.config import Params
from tasks.layout import Layout, require


class DataValidationError(RuntimeError):
    """The round's data failed the quality gate; the message is the readable report."""


def run(params: Params, layout: Layout, round_index: int) -> dict[str, Any]:
    cfg = params.validate
    frame, metadata = read_steps(require(layout.steps(round_index), f"rollout_{round_index}"))
    limits = QualityLimits(max_prompt_tokens=cfg.max_prompt_tokens, max_response_tokens=cfg.max_response_tokens,
                           reward_min=cfg.reward_min, reward_max=cfg.reward_max,
                           group_size=params.rollout.group_size)
    report = validate_steps(frame, limits, round=round_index)
    report_path = layout.round_metrics(round_index, "validate_report")
    write_json(report_path, report.to_dict())
    if not report.success:
        out = layout.validated(round_index)
        if out.exists():
            out.unlink()
        raise DataValidationError(f"round {round_index} data failed validation (report: {report_path}):\n"
                                  f"{report.render()}")
    kept, stats = (drop_zero_variance_groups(frame) if cfg.drop_zero_variance
                   else (frame, {"groups_total": int(frame["group_id"].nunique()), "groups_dropped": 0,
                                 "steps_dropped": 0}))
    export_steps(kept, layout.validated(round_index), metadata={**metadata, "validated": True, **stats})
    metrics = {"round": round_index, "steps_in": len(frame), "steps_out": len(kept),
               "expectations": len(report.results), **stats}
    write_json(layout.round_metrics(round_index, "validate"), metrics)
    return metrics
