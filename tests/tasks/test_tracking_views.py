"""What MLflow users find, read back through MlflowClient from a real SQLite store: the parent run's headline metrics
and results files, each stage run's reports, data inputs (path + DVC md5), git tags and system metrics, the
experiment tagged to open on its runs, masked credentials, and no run at all for an invocation that runs nothing.

The stage functions are stand-ins that write small files where the real stages write theirs (the project's dvc.yaml
is the real generator's); what is under test is the logging around them (flows/stages.execute_stage)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
from pathlib import Path

import mlflow
import pytest

from flows import stages
from flows.dvc_sync import render_dvc_yaml
from tasks.config import parse_params
from tasks.layout import Layout
from tasks.tracking import (EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, configure, dvc_digest, flat_params, git_tags,
                            pipeline_run)

SUMMARY = {"heldout_success": {"base": 0.0, "warmstart": 0.25, "final": 0.625, "final_with_skills": 0.75},
           "final_minus_warmstart": 0.375, "skills": {"live": 2, "success_gain": 0.125},
           "baselines": {"random": 0.05, "train_lookup": 0.1, "frontier": 0.2}}


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def rollout(params, layout: Layout, r: int) -> dict:
    time.sleep(0.6)  # several system metrics samples at the test's 0.1 s interval
    write(layout.steps(r), "steps of the round")
    write(layout.skill_trials(r), "skill trials")
    write(layout.round_metrics(r, "rollout"), json.dumps({"success_rate": 0.5}))
    return {"success_rate": 0.5}


def validate(params, layout: Layout, r: int) -> dict:
    write(layout.validated(r), "validated steps")
    write(layout.round_metrics(r, "validate_report"), json.dumps({"success": True}))
    write(layout.round_metrics(r, "validate"), json.dumps({"steps_out": 3}))
    write(layout.round_metrics(r, "validate").with_name("data_docs") / "index.html", "<html>Data Docs</html>")
    return {"steps_out": 3}


def mine(params, layout: Layout, r: int) -> dict:
    write(layout.skills(r) / "CHANGELOG.md", "round 1: mined (frequent) go-north\n")
    write(layout.round_metrics(r, "mine"), json.dumps({"live": 2}))
    return {"live": 2}


def evaluate(params, layout: Layout) -> dict:
    write(layout.evaluate_metrics, json.dumps({"heldout": {}}))
    write(layout.rounds_plot, "round,heldout_success_rate\n0,0.25\n1,0.625\n")
    write(layout.summary_metrics, json.dumps(SUMMARY))
    return {"champion_round": 1}


def transfer(params, layout: Layout) -> dict:
    write(layout.policy("transfer_llama") / "model.safetensors", "weights, never an artifact")
    write(layout.transfer_metrics, json.dumps({"models": {}}))
    return {}


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A git-committed project with the real dvc.yaml of a 1-round pipeline, train/held-out scenarios, stand-in
    stage functions and a pool URL with a password in params."""
    for name in ("MLFLOW_TRACKING_URI", "ARLFLOW_MLFLOW_PARENT_RUN_ID", "ARLFLOW_MLFLOW_SESSION",
                 "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.1")
    layout = Layout(tmp_path)
    params = parse_params({"pipeline": {"rounds": 1}, "rollout": {"pool_url": "postgresql://arl:hunter2@db:5432/pool"}})
    (tmp_path / "dvc.yaml").write_text(render_dvc_yaml(params, layout))  # from the real stage modules' imports
    for name, function in [("rollout", rollout), ("validate", validate), ("mine", mine), ("evaluate", evaluate),
                           ("transfer", transfer)]:
        monkeypatch.setitem(stages.STAGE_FUNCTIONS, name, function)
    write(layout.scenarios("train"), '{"seed": 1}\n')
    write(layout.scenarios("heldout"), '{"seed": 2}\n')
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "dvc.yaml")
    git(tmp_path, "commit", "-q", "-m", "project")
    return layout, params


def client_runs(layout: Layout) -> tuple[mlflow.MlflowClient, list]:
    client = mlflow.MlflowClient(tracking_uri=layout.mlflow_uri)
    experiment = client.get_experiment_by_name("arlflow")
    return client, client.search_runs([experiment.experiment_id]) if experiment else []


def artifact_files(client: mlflow.MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= artifact_files(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def test_a_pipeline_run_records_results_reports_inputs_and_git(project):
    layout, params = project
    (layout.root / "dvc.yaml").write_text((layout.root / "dvc.yaml").read_text() + "\n")  # a tracked file changed
    with pipeline_run(layout, params) as parent:
        for stage, round_index in [("rollout", 1), ("validate", 1), ("mine", 1), ("evaluate", None),
                                   ("transfer", None)]:
            stages.execute_stage(stage, round_index, params, layout)
    assert not [t for t in threading.enumerate() if t.name == "SystemMetricsMonitor"]  # stopped with their runs

    client, runs = client_runs(layout)
    top = [r for r in runs if r.data.tags.get("arlflow.kind") == "pipeline"]
    assert [r.info.run_id for r in top] == [parent.run_id] and top[0].info.run_name == "pipeline"
    assert top[0].info.status == "FINISHED"
    by_stage = {r.data.tags["stage"]: r for r in runs if r.data.tags.get("arlflow.kind") == "stage"}
    assert set(by_stage) == {"rollout", "validate", "mine", "evaluate", "transfer"}
    assert all(r.data.tags["mlflow.parentRunId"] == parent.run_id for r in by_stage.values())

    # the parent: the headline numbers as metrics, the results files as artifacts
    metrics = top[0].data.metrics
    assert {k: metrics[k] for k in ("heldout_success.final", "heldout_success.warmstart", "final_minus_warmstart",
                                    "baselines.random", "baselines.frontier", "skills.live")} == {
        "heldout_success.final": 0.625, "heldout_success.warmstart": 0.25, "final_minus_warmstart": 0.375,
        "baselines.random": 0.05, "baselines.frontier": 0.2, "skills.live": 2.0}
    assert artifact_files(client, parent.run_id) == {"metrics/evaluate.json", "metrics/plots/rounds.csv",
                                                     "metrics/summary.json", "metrics/transfer.json"}

    # each stage: its reports, never data or weights
    assert artifact_files(client, by_stage["rollout"].info.run_id) == {"metrics/rounds/round_1/rollout.json"}
    assert artifact_files(client, by_stage["validate"].info.run_id) == {
        "metrics/rounds/round_1/validate_report.json", "metrics/rounds/round_1/validate.json",
        "metrics/rounds/round_1/data_docs/index.html"}
    assert artifact_files(client, by_stage["mine"].info.run_id) == {"artifacts/skills/round_1/CHANGELOG.md",
                                                                    "metrics/rounds/round_1/mine.json"}
    assert artifact_files(client, by_stage["transfer"].info.run_id) == {"metrics/transfer.json"}

    # data inputs: the dvc.yaml deps under data/, by path and DVC md5
    def inputs(stage: str) -> dict[str, str]:
        run = client.get_run(by_stage[stage].info.run_id)
        return {d.dataset.name: d.dataset.digest for d in run.inputs.dataset_inputs}
    assert inputs("rollout") == {"data/scenarios/train.jsonl": md5(layout.scenarios("train"))}
    assert inputs("validate") == {"data/rounds/round_1/steps.parquet": md5(layout.steps(1))}  # no curation file
    assert inputs("transfer") == {"data/scenarios": dvc_digest(layout.scenarios_dir, None)}

    # git commit and dirty flag everywhere; params without the pool's password; system metrics on the stage runs
    commit = git(layout.root, "rev-parse", "HEAD")
    for run in [top[0], *by_stage.values()]:
        assert run.data.tags["mlflow.source.git.commit"] == commit and run.data.tags["arlflow.git.dirty"] == "true"
        assert run.data.params["rollout.pool_url"] == "postgresql://arl:***@db:5432/pool"
        assert not any("hunter2" in value for value in run.data.params.values())
    assert "system/cpu_utilization_percentage" in by_stage["rollout"].data.metrics

    experiment = client.get_experiment_by_name("arlflow")
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert experiment.artifact_location == layout.mlflow_artifacts.absolute().as_uri()  # not ./mlruns of the cwd


def test_an_invocation_that_runs_nothing_leaves_no_run(project):
    layout, params = project
    with pipeline_run(layout, params) as parent:
        pass
    assert parent.run_id is None and client_runs(layout)[1] == []


def test_a_stage_outside_the_pipeline_puts_its_results_on_its_parent(project):
    """`dvc repro` and `arlflow stage` run execute_stage with no pipeline: the same results reach their parent."""
    layout, params = project
    stages.execute_stage("evaluate", None, params, layout)
    client, runs = client_runs(layout)
    parent = next(r for r in runs if r.data.tags.get("arlflow.kind") == "pipeline")
    assert parent.data.metrics["heldout_success.final_with_skills"] == 0.75
    assert "metrics/evaluate.json" in artifact_files(client, parent.info.run_id)


def test_an_existing_experiment_is_tagged_to_open_on_its_runs_and_a_chosen_kind_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    layout = Layout(tmp_path)
    configure(layout, "made-before")
    client = mlflow.MlflowClient(tracking_uri=layout.mlflow_uri)
    old = client.get_experiment_by_name("made-before").experiment_id
    client.delete_experiment_tag(old, EXPERIMENT_KIND_TAG)  # as an experiment made before this tag
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    configure(layout, "made-before")
    configure(layout, "chosen")
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"


def test_a_directory_digest_is_dvc_s_while_the_lock_record_matches(tmp_path):
    folder = tmp_path / "scenarios"
    write(folder / "train.jsonl", "abc")
    write(folder / "games" / "g1.json", "de")
    record = {"md5": "0123456789abcdef0123456789abcdef.dir", "size": 5, "nfiles": 2}
    assert dvc_digest(folder, record) == record["md5"]
    listing = dvc_digest(folder, None)
    assert listing != record["md5"] and dvc_digest(folder, {**record, "nfiles": 3}) == listing
    write(folder / "train.jsonl", "abcd")  # changed since the lock: the listing, not the stale record
    assert dvc_digest(folder, record) not in (record["md5"], listing)
    assert dvc_digest(folder / "train.jsonl", record) == md5(folder / "train.jsonl")


def test_params_hold_no_credentials():
    params = parse_params({"rollout": {"pool_url": "postgresql://arl:hunter2@db/pool"},
                           "engine": {"urls": ["http://user:s3cret@vllm:8000/v1", "https://h/v1?api_key=k3y&x=1"],
                                      "api_key_env": "OPENAI_API_KEY"}})
    flat = flat_params(params)
    assert flat["rollout.pool_url"] == "postgresql://arl:***@db/pool"
    assert flat["engine.urls"] == ["http://user:***@vllm:8000/v1", "https://h/v1?api_key=***&x=1"]
    assert flat["engine.api_key_env"] == "OPENAI_API_KEY"  # the variable's name, not the key
    assert "***" not in json.dumps(flat_params(parse_params({})))  # nothing else masked


def test_no_git_tags_outside_a_git_checkout(tmp_path):
    assert git_tags(tmp_path) == {}
