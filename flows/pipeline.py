"""Prefect flows: one per stage, one per round, and the pipeline flow. Control flow only.

What the Prefect UI and API show: runs named by experiment and seed (`arlflow-seed0`, `arlflow-train-round-2`),
tagged `experiment:`, `seed:`, `stage:`, `round:`; every stage of the pipeline, those DVC sees as fresh as task runs
in the state Skipped; the stage code's log lines; the results table and the held-out results at the end, each
round's data gate report and skill bank changes as artifacts.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from prefect import flow, get_client, get_run_logger, tags, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.exceptions import MissingContextError
from prefect.logging.handlers import APILogHandler
from prefect.runtime import flow_run
from prefect.states import Completed, State
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff

from flows import dvc_sync
from flows.stages import ROUND_STAGES, dvc_stage_name, execute_stage, stage_sequence
from tasks import report
from tasks.config import Params, load_params
from tasks.curate import pool_url
from tasks.layout import Layout
from tasks.tracking import pipeline_run

STAGE_LOGGERS = ("arlflow", "tasks", "agents", "skills", "datapool", "models", "envs")
# Retried with backoff (10 s, then 20 s), e.g. after a lost engine server: rerunning these two is idempotent (the
# pool stores a rollout's trajectory ids once; their files are staged and committed at once, tasks/outputs.py).
RETRIES = {"rollout": 2, "evaluate": 2}
RETRY_BACKOFF_S = 10
CONCURRENT_STAGES = 2
"""pipeline.max_staleness >= 1: at most this many stages at once (a round's rollout alongside the previous train)."""
_DVC = threading.Lock()
"""DVC's status and commit calls, one at a time (its repo lock is per process; concurrent stages share it)."""


def _inside_a_run(record: logging.LogRecord) -> bool:
    try:
        get_run_context()
    except MissingContextError:
        return False
    return True


def send_stage_logs_to_prefect() -> None:
    """Send the stage code's stdlib log lines (the `arlflow.*` loggers and each package's module loggers, INFO and
    up) to the Prefect run they are logged in, as PREFECT_LOGGING_EXTRA_LOGGERS would; done here since that setting
    is read once, when prefect is first imported (a worker's flow engine imports it before loading this file).
    Lines logged outside a run (the gateway's) still print, without Prefect warning about them."""
    for name in STAGE_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        if not any(isinstance(handler, APILogHandler) for handler in logger.handlers):
            handler = APILogHandler()
            handler.addFilter(_inside_a_run)
            logger.addHandler(handler)


send_stage_logs_to_prefect()


def _run_params() -> Params:
    """The params.yaml of the flow run in progress (its `root` parameter)."""
    return load_params(Path(flow_run.parameters.get("root", ".")).resolve() / "params.yaml")


def _run_tags(params: Params, stage: str | None = None, round_index: int | None = None) -> list[str]:
    found = [f"experiment:{params.pipeline.experiment}", f"seed:{params.pipeline.seed}"]
    found += [f"stage:{stage}"] if stage else []
    return found + ([f"round:{round_index}"] if round_index is not None else [])


def _tag_this_flow_run(run_tags: list[str]) -> None:
    """Add tags to the flow run in progress: a flow takes tags only from its caller's `prefect.tags`, and these
    come from params.yaml, read once the run started."""
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, tags=sorted({*flow_run.tags, *run_tags}))


def _artifact_key(params: Params, *parts: object) -> str:
    """`<experiment>-seed<seed>-<parts>` in the lowercase letters, digits and dashes Prefect requires of keys."""
    raw = "-".join([params.pipeline.experiment, f"seed{params.pipeline.seed}", *map(str, parts)]).lower()
    return "-".join("".join(c if c.isalnum() and c.isascii() else " " for c in raw).split())


def _stage_task_name(parameters: dict[str, Any]) -> str:
    return dvc_stage_name(parameters["stage"], parameters["round_index"])


@task(cache_policy=NO_CACHE, task_run_name=_stage_task_name)
def stage_task(stage: str, round_index: int | None, root: str) -> dict[str, Any]:
    layout = Layout(Path(root).resolve())
    return execute_stage(stage, round_index, load_params(layout.root / "params.yaml"), layout)


def stage_task_for(stage: str):
    """stage_task, with retries and backoff for the stages in RETRIES."""
    if stage not in RETRIES:
        return stage_task
    return stage_task.with_options(retries=RETRIES[stage], retry_delay_seconds=exponential_backoff(RETRY_BACKOFF_S))


@task(cache_policy=NO_CACHE, task_run_name="{name}")
def skipped_stage(name: str) -> State:
    """A stage DVC sees as up to date, shown in the run's graph as a task run in the state Skipped."""
    return Completed(name="Skipped", message=f"{name} is up to date (dvc status): not rerun")


def publish_stage_artifacts(stage: str, round_index: int | None, params: Params, layout: Layout) -> None:
    """A validate round's data gate report and a mine round's skill bank changes, as Prefect markdown artifacts."""
    if stage == "validate":
        create_markdown_artifact(report.validate_summary(layout, round_index),
                                 key=_artifact_key(params, "validate-round", round_index),
                                 description=f"the data gate's report of round {round_index}")
    elif stage == "mine":
        create_markdown_artifact(report.skill_changes(layout, round_index),
                                 key=_artifact_key(params, "skills-round", round_index),
                                 description=f"the skill bank's changes in round {round_index}")


def publish_results(params: Params, layout: Layout, table: str) -> None:
    """The results table (markdown) and the held-out results per policy (a table artifact)."""
    create_markdown_artifact(table, key=_artifact_key(params, "results"), description="the pipeline's results")
    evaluation, _ = report.load_json(layout.evaluate_metrics, "evaluate")
    if evaluation is not None:
        create_table_artifact(report.policy_rows(evaluation), key=_artifact_key(params, "heldout"),
                              description="held-out success per policy and baseline (metrics/evaluate.json)")


def _stage_run_name(stage: str):
    def name() -> str:
        round_index = flow_run.parameters.get("round_index")
        suffix = f"-round-{round_index}" if round_index is not None else ""
        return f"{_run_params().pipeline.experiment}-{stage}{suffix}"

    return name


def _make_stage_flow(stage: str):
    @flow(name=stage, flow_run_name=_stage_run_name(stage))
    def stage_flow(root: str = ".", round_index: int | None = None) -> dict[str, Any]:
        layout = Layout(Path(root).resolve())
        params = load_params(layout.root / "params.yaml")
        run_tags = _run_tags(params, stage, round_index)
        _tag_this_flow_run(run_tags)
        with tags(*run_tags):
            state = stage_task_for(stage)(stage, round_index, root, return_state=True)
        if state.is_completed() or stage == "validate":  # a failed gate's report too (validate_report.failed.json)
            publish_stage_artifacts(stage, round_index, params, layout)
        return state.result()

    return stage_flow


STAGE_FLOWS = {stage: _make_stage_flow(stage) for stage in
               ("bootstrap", "curate", "warmstart", *ROUND_STAGES, "evaluate", "transfer")}
# module-level names, so deployments (infra/prefect.yaml) can point at each stage flow
bootstrap_flow, curate_flow, warmstart_flow = (STAGE_FLOWS[s] for s in ("bootstrap", "curate", "warmstart"))
rollout_flow, validate_flow, mine_flow, train_flow = (STAGE_FLOWS[s] for s in ROUND_STAGES)
evaluate_flow, transfer_flow = STAGE_FLOWS["evaluate"], STAGE_FLOWS["transfer"]


def _run_or_skip(stage: str, round_index: int | None, params: Params, layout: Layout, force: bool) -> bool:
    """One stage of the pipeline: nothing when DVC sees it as fresh (unless force; returns False), else its flow,
    then committed to dvc.lock (returns True)."""
    name = dvc_stage_name(stage, round_index)
    with _DVC:
        fresh = not force and not dvc_sync.is_stale(layout, name)
    if fresh:
        get_run_logger().info("stage %s is up to date (dvc status): skipped", name)
        return False
    STAGE_FLOWS[stage](root=str(layout.root), round_index=round_index)
    with _DVC:
        dvc_sync.commit(layout, name)
    return True


def _in_sequence(params: Params, layout: Layout, force: bool) -> list[tuple[str, bool]]:
    """The stages one after the other (max_staleness 0), in the flow's own thread; a fresh one is a Skipped task."""
    done = []
    for stage, round_index in stage_sequence(params.pipeline.rounds):
        name = dvc_stage_name(stage, round_index)
        ran = _run_or_skip(stage, round_index, params, layout, force)
        if not ran:
            with tags(*_run_tags(params, stage, round_index)):
                skipped_stage(name)
        done.append((name, ran))
    return done


def _dag_stage_name(parameters: dict[str, Any]) -> str:
    return dvc_stage_name(parameters["stage"], parameters["round_index"])


@task(cache_policy=NO_CACHE, task_run_name=_dag_stage_name)
def dag_stage(stage: str, round_index: int | None, root: str, force: bool) -> State | None:
    """A stage of a pipeline with max_staleness >= 1: waits (wait_for) on the stages dvc.yaml makes it depend on,
    then runs as `_run_or_skip`; a fresh one ends in the state Skipped, as in the synchronous pipeline."""
    layout = Layout(Path(root))
    if _run_or_skip(stage, round_index, load_params(layout.root / "params.yaml"), layout, force):
        return None
    name = dvc_stage_name(stage, round_index)
    return Completed(name="Skipped", message=f"{name} is up to date (dvc status): not rerun")


def _run_concurrently(params: Params, layout: Layout, force: bool) -> list[tuple[str, bool]]:
    """Every stage as a task run that starts once the stages it depends on in dvc.yaml are done
    (dvc_sync.stage_dependencies), CONCURRENT_STAGES at a time: with max_staleness k >= 1, rollout_{r+1} samples
    with round r-k's policy and runs alongside train_r. A failed stage fails the run; its dependents never start.
    Every stage keeps torch's thread count: fewer threads per concurrent stage changes float reductions, and so the
    results, which must equal `dvc repro`'s (on 2 cores it was also slower: 0.83x vs 0.90x, seed 0)."""
    graph = dvc_sync.stage_dependencies(params, layout)
    futures: dict[str, Any] = {}
    for stage, round_index in stage_sequence(params.pipeline.rounds):
        name = dvc_stage_name(stage, round_index)
        with tags(*_run_tags(params, stage, round_index)):
            futures[name] = dag_stage.submit(stage, round_index, str(layout.root), force,
                                             wait_for=[futures[upstream] for upstream in graph[name]])
    for future in futures.values():
        future.wait()
    failed = [name for name, future in futures.items() if not future.state.is_completed()]
    if failed:
        futures[failed[0]].result()  # raises the first failed stage's own error
        raise RuntimeError(f"stages {failed} did not complete")
    return [(name, future.state.name != "Skipped") for name, future in futures.items()]


def _pipeline_run_name() -> str:
    params = _run_params()
    return f"{params.pipeline.experiment}-seed{params.pipeline.seed}"


@flow(name="pipeline", flow_run_name=_pipeline_run_name, log_prints=True,
      task_runner=ThreadPoolTaskRunner(max_workers=CONCURRENT_STAGES))
def pipeline_flow(root: str = ".", force: bool = False) -> dict[str, Any]:
    """bootstrap -> warmstart -> rounds -> evaluate -> transfer; stages DVC sees as fresh are skipped
    (force=True reruns all), and each finished stage is committed to dvc.lock, so `dvc repro` afterwards is a no-op.
    Returns the stages run and skipped and the results table (markdown), also published as an artifact."""
    logger = get_run_logger()
    layout = Layout(Path(root).resolve())
    params = load_params(layout.root / "params.yaml")
    dvc_sync.check_dvc_yaml(params, layout)
    run_tags = _run_tags(params)
    _tag_this_flow_run(run_tags)
    with pipeline_run(layout, params) as parent_run, tags(*run_tags):
        run = _in_sequence if params.pipeline.max_staleness == 0 else _run_concurrently
        done = run(params, layout, force)
    ran = [name for name, was_run in done if was_run]
    skipped = [name for name, was_run in done if not was_run]
    table = report.results_table(layout, pool_url(params, layout))
    publish_results(params, layout, table)
    logger.info("pipeline done: ran %s, skipped %s; MLflow parent run %s", ran, skipped, parent_run)
    return {"ran": ran, "skipped": skipped, "mlflow_parent_run": parent_run.run_id, "results": table}
