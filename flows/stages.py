"""The stage table: which function runs each stage, in which order, and the single entry both DVC and Prefect use."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flows.stage_order import ROUND_STAGES, dvc_stage_name, stage_sequence  # noqa: F401 - the stage table's API
from flows.stage_order import check_stage as _check_stage
from tasks import bootstrap, curate, evaluate, mine, rollout, train, transfer, validate, warmstart
from tasks.config import Params
from tasks.layout import Layout
from tasks.outputs import recover
from tasks.tracking import log_metrics, log_stage_inputs, log_stage_outputs, stage_run

STAGE_FUNCTIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "bootstrap": bootstrap.run,
    "curate": curate.run,
    "warmstart": warmstart.run,
    "rollout": rollout.run,
    "validate": validate.run,
    "mine": mine.run,
    "train": train.run,
    "evaluate": evaluate.run,
    "transfer": transfer.run,
}


def check_stage(stage: str, round_index: int | None, params: Params) -> None:
    _check_stage(stage, round_index, params.pipeline.rounds)


def run_stage_functions(params: Params, layout: Layout, *, include: tuple[str, ...] = ("bootstrap", "warmstart",
                        "rollout", "validate", "train"), start_round: int = 1) -> None:
    """The stage functions in pipeline order without Prefect or MLflow (tests and benchmarks); `include` picks
    stages, `start_round` skips earlier rounds' stages."""
    for stage, round_index in stage_sequence(params.pipeline.rounds):
        if stage not in include or (round_index is not None and round_index < start_round):
            continue
        recover(layout.root)
        function = STAGE_FUNCTIONS[stage]
        function(params, layout) if round_index is None else function(params, layout, round_index)


def execute_stage(stage: str, round_index: int | None, params: Params, layout: Layout) -> dict[str, Any]:
    """Run one stage function inside its MLflow stage run: the one code path of every stage. A commit that a
    killed stage left half-done is rolled forward first, so the stage never reads outputs of two runs mixed
    (tasks/outputs.py). The run records the stage's data inputs, its metrics and its reports (tasks/tracking.py)."""
    check_stage(stage, round_index, params)
    recover(layout.root)
    function = STAGE_FUNCTIONS[stage]
    with stage_run(layout, params, stage, round_index):
        log_stage_inputs(layout, stage, round_index)
        metrics = function(params, layout) if round_index is None else function(params, layout, round_index)
        log_metrics(metrics)
        log_stage_outputs(layout, stage, round_index)
    return metrics
