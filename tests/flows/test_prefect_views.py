"""What Prefect shows of a pipeline run, read back through its API from a real (test harness) server: run names,
tags, retries on rollout only, skipped stages in the state Skipped, artifacts, the stage code's log lines, and the
results table `arlflow pipeline` prints. The stages are stand-ins: the Prefect wiring is what is under test."""
import json
import logging

import pytest
import yaml
from typer.testing import CliRunner

import flows.pipeline as pipeline
from flows.cli import app
from flows.stages import STAGE_FUNCTIONS
from tasks.config import params_to_dict, parse_params
from tasks.layout import Layout

STALE = {"rollout_1", "validate_1", "mine_1"}    # the stages that run; DVC "sees" every other one as fresh
EVALUATION = {"heldout_scenarios": 4, "seed": 7,
              "heldout": {name: {"success_rate": rate, "mean_return": rate, "episodes": 4}
                          for name, rate in [("base", 0.0), ("warmstart", 0.25), ("final", 0.5),
                                             ("final_with_skills", 0.75)]},
              "rounds": {"round_1": {"success_rate": 0.5, "mean_return": 0.5, "episodes": 4}},
              "baselines": {"random": {"mean": 0.1, "std": 0.05}, "heuristics": {}, "seeds": [0, 1],
                            "train_lookup": {"mean": 0.0, "std": 0.0}, "heldout_scenarios": 4,
                            "final_above_every_baseline": True}}


def fake_stage(attempts: dict):
    """A stand-in for execute_stage: logs through a stdlib `arlflow.*` logger, writes the files the artifacts
    read, and loses its 'engine server' on the first rollout attempt."""
    def execute_stage(stage, round_index, params, layout: Layout):
        attempts[stage] = attempts.get(stage, 0) + 1
        logging.getLogger("arlflow.views-probe").info("probe line from %s, attempt %d", stage, attempts[stage])
        if stage == "rollout" and attempts[stage] == 1:
            raise ConnectionError("engine server went away")
        if stage == "validate":
            path = layout.round_metrics(round_index, "validate_report")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"success": True, "row_count": 12, "message": "", "results": [
                {"name": "", "expectation_type": "expect_column_values_to_not_be_null", "column": "reward",
                 "success": True, "unexpected_count": 0}]}))
        if stage == "mine":
            bank = layout.skills(round_index)
            bank.mkdir(parents=True, exist_ok=True)
            (bank / "CHANGELOG.md").write_text("round 0: mined 1\nadded walk v1 {}\nround 1: mined 2\n"
                                               "promoted walk v1 {\"u\": 0.3}\n")
        return {"attempt": attempts[stage]}

    return execute_stage


@pytest.fixture
def probe_project(tmp_path, stand_in_stages):
    params = parse_params({"pipeline": {"rounds": 1, "seed": 7, "experiment": "Views_Probe"}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params_to_dict(params)))
    layout = Layout(tmp_path)
    layout.evaluate_metrics.parent.mkdir(parents=True)
    layout.evaluate_metrics.write_text(json.dumps(EVALUATION))
    attempts: dict = {}
    stand_in_stages(fake_stage(attempts), lambda name: name in STALE)
    return tmp_path, attempts


def test_only_rollout_and_evaluate_are_retried():
    retries = {stage: pipeline.stage_task_for(stage).retries for stage in STAGE_FUNCTIONS}
    assert retries == {stage: (2 if stage in ("rollout", "evaluate") else 0) for stage in STAGE_FUNCTIONS}
    assert pipeline.stage_task_for("rollout").retry_delay_seconds == [10, 20]


@pytest.mark.slow
def test_a_pipeline_run_as_prefect_shows_it(probe_project, prefect_harness):
    from prefect import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter,
                                                FlowRunFilterTags, LogFilter, LogFilterFlowRunId, TaskRunFilter,
                                                TaskRunFilterFlowRunId)
    from prefect.logging.handlers import APILogHandler

    root, attempts = probe_project
    printed = CliRunner().invoke(app, ["pipeline", "--root", str(root)])
    assert printed.exit_code == 0, printed.output
    # the CLI ends with the results table and where to look next
    assert "| final (round_1)" in printed.output and "0.100 ± 0.050" in printed.output
    assert "Final policy above every baseline: yes" in printed.output
    assert "mlflow ui --backend-store-uri sqlite:///" in printed.output and "prefect flow-run ls" in printed.output
    assert attempts == {"rollout": 2, "validate": 1, "mine": 1}
    APILogHandler().flush()  # the log lines reach the server in batches

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=["experiment:Views_Probe"])))
        by_name = {run.name: run for run in runs}
        assert set(by_name) == {"Views_Probe-seed7", "Views_Probe-rollout-round-1", "Views_Probe-validate-round-1",
                                "Views_Probe-mine-round-1"}
        assert {"experiment:Views_Probe", "seed:7"} <= set(by_name["Views_Probe-seed7"].tags)
        assert {"experiment:Views_Probe", "seed:7", "stage:mine", "round:1"} <= set(
            by_name["Views_Probe-mine-round-1"].tags)
        ids = [run.id for run in runs]
        tasks = {t.name: t for t in client.read_task_runs(task_run_filter=TaskRunFilter(
            flow_run_id=TaskRunFilterFlowRunId(any_=ids)))}
        assert {"bootstrap", "curate", "warmstart", "rollout_1", "validate_1", "mine_1", "train_1", "evaluate",
                "transfer"} <= set(tasks)   # besides those Prefect makes for the subflows (`rollout-0`)
        for name in ("bootstrap", "train_1", "transfer"):
            assert tasks[name].state.type.value == "COMPLETED" and tasks[name].state.name == "Skipped", name
            assert "up to date" in tasks[name].state.message
        assert {"stage:train", "round:1", "seed:7"} <= set(tasks["train_1"].tags)
        assert tasks["rollout_1"].state.name == "Completed" and tasks["rollout_1"].run_count == 2
        assert {"stage:rollout", "round:1", "experiment:Views_Probe"} <= set(tasks["rollout_1"].tags)

        artifacts = {a.key: a for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids)))}
        assert set(artifacts) == {"views-probe-seed7-results", "views-probe-seed7-heldout",
                                  "views-probe-seed7-validate-round-1", "views-probe-seed7-skills-round-1"}
        assert artifacts["views-probe-seed7-heldout"].type == "table"
        assert "| final_with_skills" in artifacts["views-probe-seed7-results"].data
        assert "passed" in artifacts["views-probe-seed7-validate-round-1"].data
        assert "promoted walk v1" in artifacts["views-probe-seed7-skills-round-1"].data
        assert "added walk v1" not in artifacts["views-probe-seed7-skills-round-1"].data   # round 0's line

        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[by_name["Views_Probe-rollout-round-1"].id])))
        probe = [log for log in logs if log.name == "arlflow.views-probe"]
        assert [log.message for log in probe] == ["probe line from rollout, attempt 1",
                                                  "probe line from rollout, attempt 2"]
        assert all(log.task_run_id == tasks["rollout_1"].id for log in probe)


@pytest.mark.slow
def test_a_failed_data_gate_still_publishes_its_report(probe_project, prefect_harness, monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    root, _ = probe_project

    def failing_gate(stage, round_index, params, layout: Layout):
        failed = layout.round_metrics(round_index, "validate_report").with_name("validate_report.failed.json")
        failed.parent.mkdir(parents=True, exist_ok=True)
        failed.write_text(json.dumps({"success": False, "row_count": 5, "message": "", "results": [
            {"name": "", "expectation_type": "expect_column_values_to_be_between", "column": "reward",
             "success": False, "unexpected_count": 3}]}))
        raise RuntimeError(f"round {round_index} data failed validation")

    monkeypatch.setattr(pipeline, "execute_stage", failing_gate)
    with pytest.raises(RuntimeError, match="failed validation"):
        pipeline.STAGE_FLOWS["validate"](root=str(root), round_index=1)
    with get_client(sync_client=True) as client:
        [latest] = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=["views-probe-seed7-validate-round-1"])), sort=ArtifactSort.CREATED_DESC, limit=1)
    assert latest.data.startswith("## Data gate, round 1: FAILED") and "| FAILED" in latest.data
