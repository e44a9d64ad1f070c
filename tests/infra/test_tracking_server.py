"""The tracking server profile (infra/mlflow-server.sh) as the pipeline uses it, through MLFLOW_TRACKING_URI and the
stages' own logging (tasks/tracking.py): a SQLite store with artifacts in a real S3 bucket (SeaweedFS, credentials
enforced, held by the server only), a PostgreSQL store; and the project's local store after the project folder moved.

One server per module (start-up takes 10-25 s), in its own process group, stopped with it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import boto3
import mlflow
import pytest
from sqlalchemy import create_engine, text

from tasks.config import parse_params
from tasks.layout import Layout
from tasks.tracking import (configure, log_metrics, log_stage_inputs, log_stage_outputs, pipeline_run, register_policy,
                            stage_run)
from tests.servers import REPO, _free_port

DVC_YAML = {"stages": {"rollout_1": {"deps": ["data/scenarios/train.jsonl"],
                                     "outs": ["metrics/rounds/round_1/rollout.json"]},
                       "evaluate": {"outs": ["metrics/evaluate.json"]}}}
POOL_PASSWORD = "hunter2"


@dataclass
class MlflowServer:
    """infra/mlflow-server.sh running: its URL, log, and process group (the server and its uvicorn worker)."""
    url: str
    log: Path
    process: subprocess.Popen = field(repr=False)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)


def start_mlflow_server(store: str, artifacts: str, env: dict[str, str], log: Path,
                        timeout_s: float = 180.0) -> MlflowServer:
    """Start the profile on a free loopback port; wait until /health answers."""
    port = _free_port()
    with log.open("wb") as out:
        process = subprocess.Popen([str(REPO / "infra" / "mlflow-server.sh"), str(port), store, artifacts], env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = MlflowServer(f"http://127.0.0.1:{port}", log, process)
    started, deadline = time.monotonic(), time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as answer:
                if answer.status == 200:
                    print(f"mlflow server up in {time.monotonic() - started:.1f} s")
                    return server
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            pytest.fail(f"infra/mlflow-server.sh did not answer on {server.url}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def s3_tracking(s3_server, tmp_path_factory) -> Iterator[tuple[MlflowServer, str]]:
    """The profile on SQLite with artifacts under s3://BUCKET/mlflow; the server alone holds the S3 keys."""
    bucket = f"arlflow-mlflow-{os.getpid()}"
    s3_server.client().create_bucket(Bucket=bucket)
    folder = tmp_path_factory.mktemp("mlflow-server")
    server = start_mlflow_server(str(folder / "store"), f"s3://{bucket}/mlflow", s3_server.env(),
                                 folder / "server.log")
    try:
        yield server, bucket
    finally:
        server.stop()


@pytest.fixture
def client_env(monkeypatch) -> Iterator[None]:
    """A client as on a teammate's machine: no AWS keys, endpoint or config (boto3 finds no credentials); MLflow's
    process-wide tracking URI is put back afterwards."""
    for name in [n for n in os.environ if n.startswith(("AWS_", "MLFLOW_S3_"))] + [
            "MLFLOW_TRACKING_URI", "ARLFLOW_MLFLOW_PARENT_RUN_ID", "ARLFLOW_MLFLOW_SESSION"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    previous = mlflow.get_tracking_uri()
    yield
    mlflow.set_tracking_uri(previous)


@pytest.fixture
def project(tmp_path, client_env) -> tuple[Layout, object]:
    """A project with the dvc.yaml entries of two stages, their inputs, and a pool URL with a password in params."""
    layout = Layout(tmp_path / "project")
    layout.root.mkdir()
    (layout.root / "dvc.yaml").write_text(json.dumps(DVC_YAML))
    write(layout.scenarios("train"), '{"seed": 1}\n')
    return layout, parse_params({"rollout": {"pool_url": f"postgresql://arl:{POOL_PASSWORD}@db:5432/pool"}})


def write(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)


def run_stages(layout: Layout, params) -> dict[str, str]:
    """rollout round 1 and evaluate in one pipeline run, logged as flows/stages.execute_stage logs a stage (stand-in
    reports); run id by stage."""
    runs = {}
    with pipeline_run(layout, params):
        for stage, round_index, report in [("rollout", 1, layout.round_metrics(1, "rollout")),
                                           ("evaluate", None, layout.evaluate_metrics)]:
            with stage_run(layout, params, stage, round_index) as run_id:
                log_stage_inputs(layout, stage, round_index)
                write(report, json.dumps({"stage": stage, "success_rate": 0.5}))
                log_metrics({"success_rate": 0.5, "per_env": {"household": 0.25}})
                log_stage_outputs(layout, stage, round_index)
            runs[stage] = run_id
    return runs


def bucket_keys(s3_server, bucket: str) -> set[str]:
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {item["Key"] for page in pages for item in page.get("Contents", [])}


@pytest.mark.slow
def test_stages_log_through_the_server_into_the_bucket_from_a_client_without_keys(s3_tracking, s3_server, project,
                                                                                 tiny_policy_dir, monkeypatch,
                                                                                 tmp_path):
    from models.build import load_policy

    (server, bucket), (layout, params) = s3_tracking, project
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    assert boto3.Session().get_credentials() is None  # this client could not write to S3 itself
    runs = run_stages(layout, params)
    with mlflow.start_run(run_id=runs["evaluate"]):  # as train registers its round's policy
        register_policy(*load_policy(tiny_policy_dir), params.pipeline.registered_model, tags={"round": "1"})

    client = mlflow.MlflowClient()
    run = client.get_run(runs["evaluate"])
    assert run.data.metrics["success_rate"] == 0.5 and run.data.metrics["per_env.household"] == 0.25
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.artifact_location == f"mlflow-artifacts:/{experiment.experiment_id}"  # the server's choice
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")
    downloaded = client.download_artifacts(runs["evaluate"], "metrics/evaluate.json", str(tmp_path / "download"))
    assert json.loads(Path(downloaded).read_text()) == {"stage": "evaluate", "success_rate": 0.5}
    parent = run.data.tags["mlflow.parentRunId"]
    assert {f"mlflow/{experiment.experiment_id}/{run_id}/artifacts/{path}" for run_id, path in [
        (runs["rollout"], "metrics/rounds/round_1/rollout.json"), (runs["evaluate"], "metrics/evaluate.json"),
        (parent, "metrics/evaluate.json")]} <= (keys := bucket_keys(s3_server, bucket))
    assert [k for k in keys if k.startswith(f"mlflow/{experiment.experiment_id}/models/")
            and k.endswith("/model.safetensors")]  # the policy's weights
    assert not layout.mlflow_db.exists() and not layout.mlflow_artifacts.exists()  # nothing local forced on it
    assert not (layout.root / "mlruns").exists()


@pytest.mark.slow
def test_no_credential_reaches_runs_or_the_store(s3_tracking, s3_server, project, monkeypatch):
    (server, _), (layout, params) = s3_tracking, project
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    runs = run_stages(layout, params)
    client = mlflow.MlflowClient()
    experiment_id = client.get_run(runs["evaluate"]).info.experiment_id
    recorded = [client.get_experiment(experiment_id).tags]
    for run in client.search_runs([experiment_id]):
        recorded += [run.data.params, run.data.tags]
    assert client.get_run(runs["evaluate"]).data.params["rollout.pool_url"] == "postgresql://arl:***@db:5432/pool"
    everything = json.dumps(recorded)
    store = next(Path(server.log.parent).rglob("mlflow.db")).read_bytes()
    for secret in (s3_server.secret_key, POOL_PASSWORD):
        assert secret not in everything and secret.encode() not in store


@pytest.mark.slow
def test_a_postgresql_store_logs_and_lists_runs(postgres_database, project, monkeypatch, tmp_path):
    layout, params = project
    database = postgres_database()
    server = start_mlflow_server(database, str(tmp_path / "artifacts"), dict(os.environ), tmp_path / "server.log")
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
        runs = run_stages(layout, params)
        client = mlflow.MlflowClient()
        experiment = client.get_experiment_by_name(params.pipeline.experiment)
        listed = client.search_runs([experiment.experiment_id])
        stage_runs = {r.data.tags["stage"]: r.info.run_id for r in listed if r.data.tags.get("arlflow.kind") == "stage"}
        assert stage_runs == runs and len(listed) == 3  # and their parent
        assert [a.path for a in client.list_artifacts(runs["evaluate"], "metrics")] == ["metrics/evaluate.json"]
        assert (tmp_path / "artifacts" / experiment.experiment_id / runs["evaluate"] / "artifacts" / "metrics"
                / "evaluate.json").exists()
    finally:
        server.stop()
    engine = create_engine(database)
    with engine.connect() as conn:  # the runs are in PostgreSQL, not in a file next to the server
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar_one() == 3
    engine.dispose()


@pytest.mark.slow
def test_a_moved_project_keeps_its_runs_artifacts_and_policies(project, tiny_policy_dir, tmp_path):
    """Copy the project folder elsewhere and delete the original: MLflow's locations are absolute, the next
    configure() re-roots them, and plain MLflow APIs list and download everything again."""
    from models.build import load_policy

    layout, params = project
    runs = run_stages(layout, params)
    with mlflow.start_run(run_id=runs["evaluate"]):
        version = register_policy(*load_policy(tiny_policy_dir), params.pipeline.registered_model, tags={"round": "1"})

    moved = Layout(tmp_path / "moved")
    shutil.copytree(layout.root, moved.root, symlinks=True)
    shutil.rmtree(layout.root)
    client = mlflow.MlflowClient(tracking_uri=moved.mlflow_uri)
    assert client.list_artifacts(runs["evaluate"], "metrics") == []  # MLflow still looks in the deleted folder

    relocated = subprocess.run([sys.executable, "-m", "flows.cli_main", "relocate-mlflow", "--root", str(moved.root)],
                               capture_output=True, text=True, timeout=120, cwd=REPO)  # what a user runs after a move
    assert relocated.returncode == 0 and f"-> {moved.root}" in relocated.stdout, relocated.stderr
    mlflow.set_tracking_uri(moved.mlflow_uri)  # this process still points at the deleted project's store
    assert [a.path for a in client.list_artifacts(runs["evaluate"], "metrics")] == ["metrics/evaluate.json"]
    downloaded = client.download_artifacts(runs["rollout"], "metrics/rounds/round_1/rollout.json",
                                           str(tmp_path / "download"))
    assert json.loads(Path(downloaded).read_text())["stage"] == "rollout"
    policy = mlflow.artifacts.download_artifacts(f"models:/{params.pipeline.registered_model}/{version}",
                                                 tracking_uri=moved.mlflow_uri, dst_path=str(tmp_path / "policy"))
    assert list(Path(policy).rglob("model.safetensors"))
    inputs = client.get_run(runs["rollout"]).inputs.dataset_inputs
    assert [json.loads(d.dataset.source)["uri"] for d in inputs] == [str(moved.scenarios("train"))]
    assert configure(moved, params.pipeline.experiment) == moved.mlflow_uri  # a second open changes nothing
    assert not (moved.root / "mlruns").exists()


def test_a_sqlite_store_keeps_artifacts_beside_it_from_any_working_directory(tmp_path, client_env, monkeypatch):
    """MLflow's default for a new experiment is ./mlruns of whatever directory the process runs in."""
    layout, elsewhere = Layout(tmp_path / "project"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    layout.root.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/shared/mlflow.db")
    (tmp_path / "shared").mkdir()
    configure(layout, "shared")
    assert mlflow.get_experiment_by_name("shared").artifact_location == (tmp_path / "shared/mlartifacts").as_uri()

    monkeypatch.chdir(layout.root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")  # the project's store, named relatively
    configure(layout, "relative")
    assert mlflow.get_experiment_by_name("relative").artifact_location == layout.mlflow_artifacts.as_uri()
    assert not (elsewhere / "mlruns").exists() and not (layout.root / "mlruns").exists()
