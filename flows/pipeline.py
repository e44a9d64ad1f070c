"""Prefect flows: one per stage, one per round, and the pipeline flow. Control flow only."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows import dvc_sync
from flows.stages import ROUND_STAGES, dvc_stage_name, execute_stage, stage_sequence
from tasks.config import load_params
from tasks.layout import Layout
from tasks.tracking import pipeline_run


@task(cache_policy=NO_CACHE, task_run_name="{stage}-{round_index}")
def stage_task(stage: str, round_index: int | None, root: str) -> dict[str, Any]:
    layout = Layout(Path(root).resolve())
    return execute_stage(stage, round_index, load_params(layout.root / "params.yaml"), layout)


def _make_stage_flow(stage: str):
    @flow(name=stage, flow_run_name=f"{stage}" + ("-round-{round_index}" if stage in ROUND_STAGES else ""))
    def stage_flow(root: str = ".", round_index: int | None = None) -> dict[str, Any]:
        return stage_task(stage, round_index, root)

    return stage_flow


STAGE_FLOWS = {stage: _make_stage_flow(stage) for stage in
               ("bootstrap", "curate", "warmstart", *ROUND_STAGES, "evaluate", "transfer")}
# module-level names, so deployments (infra/prefect.yaml) can point at each stage flow
bootstrap_flow, curate_flow, warmstart_flow = (STAGE_FLOWS[s] for s in ("bootstrap", "curate", "warmstart"))
rollout_flow, validate_flow, mine_flow, train_flow = (STAGE_FLOWS[s] for s in ROUND_STAGES)
evaluate_flow, transfer_flow = STAGE_FLOWS["evaluate"], STAGE_FLOWS["transfer"]


@flow(name="pipeline", log_prints=True)
def pipeline_flow(root: str = ".", force: bool = False) -> dict[str, Any]:
    """bootstrap -> warmstart -> rounds -> evaluate -> transfer; stages DVC sees as fresh are skipped
    (force=True reruns all), and each finished stage is committed to dvc.lock, so `dvc repro` afterwards is a no-op."""
    logger = get_run_logger()
    layout = Layout(Path(root).resolve())
    params = load_params(layout.root / "params.yaml")
    dvc_sync.check_dvc_yaml(params, layout)
    ran, skipped = [], []
    with pipeline_run(layout, params) as parent_run:
        for stage, round_index in stage_sequence(params.pipeline.rounds):
            name = dvc_stage_name(stage, round_index)
            if not force and not dvc_sync.is_stale(layout, name):
                logger.info("stage %s is up to date (dvc status): skipped", name)
                skipped.append(name)
                continue
            STAGE_FLOWS[stage](root=str(layout.root), round_index=round_index)
            dvc_sync.commit(layout, name)
            ran.append(name)
    logger.info("pipeline done: ran %s, skipped %s; MLflow parent run %s", ran, skipped, parent_run)
    return {"ran": ran, "skipped": skipped, "mlflow_parent_run": parent_run}
