"""MLflow tracking: one parent run per pipeline run, one nested run per stage (tags: stage, round).

The store defaults to SQLite under the project (mlflow.db) with a local artifact folder; MLFLOW_TRACKING_URI
overrides it (e.g. a tracking server with S3 artifacts).
Under `arlflow pipeline` the parent run is opened by the pipeline flow. Under `dvc repro` every stage is its own
process: they share one parent run per `dvc repro` invocation (found by the dvc process that launched them).
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

from tasks.config import Params, params_to_dict
from tasks.layout import Layout

PARENT_ENV = "ARLFLOW_MLFLOW_PARENT_RUN_ID"


def create_sqlite_store(path: Path, artifact_root: str) -> None:
    """Create the project's SQLite store all at once if it is missing. MLflow builds a new store's tables through
    dozens of migrations; a stage killed among them left a store that every later stage failed to open ("table
    webhooks already exists"). It is built in a temporary file and hard-linked into place once complete (a link
    never replaces a store another stage made first); temporaries of killed builds are removed."""
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        pid = stale.name.split(".tmp-", 1)[1].split("-")[0]       # also its -journal
        if pid.isdigit() and not _process_alive(int(pid)):
            stale.unlink(missing_ok=True)
    if path.exists():
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        SqlAlchemyStore(f"sqlite:///{tmp}", artifact_root).engine.dispose()
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def configure(layout: Layout, experiment: str) -> str:
    """Point MLflow at the project's store (unless MLFLOW_TRACKING_URI is set) and select the experiment."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or layout.mlflow_uri
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        create_sqlite_store(layout.mlflow_db, layout.mlflow_artifacts.absolute().as_uri())
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        location = None if os.environ.get("MLFLOW_TRACKING_URI") else layout.mlflow_artifacts.absolute().as_uri()
        mlflow.create_experiment(experiment, artifact_location=location)
    mlflow.set_experiment(experiment)
    return uri


def flat_params(params: Params) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in params_to_dict(params).items()
            for key, value in values.items()}


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, prefix: str = "") -> None:
    """Log the finite numeric entries of metrics to the active run (no-op without one); nested mappings (e.g.
    ``per_env``) are logged with dotted names (``per_env.household.success_rate``)."""
    if mlflow.active_run() is None:
        return
    numeric = {name: float(value) for name, value in _flatten(metrics, prefix).items()
               if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))}
    if numeric:
        mlflow.log_metrics(numeric, step=step)


def _flatten(metrics: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _dvc_session_key() -> str | None:
    """Identify the `dvc repro` process that launched this stage (Linux /proc), so its stages share a parent run."""
    pid = os.getppid()
    for _ in range(6):
        stat = Path(f"/proc/{pid}/stat")
        cmdline = Path(f"/proc/{pid}/cmdline")
        if not stat.exists():
            return None
        args = cmdline.read_bytes().split(b"\0")
        if any(Path(a.decode(errors="ignore")).name == "dvc" for a in args[:2]) or b"dvc" in args[0].split(b"/")[-1]:
            start_time = stat.read_text().rsplit(")", 1)[1].split()[19]
            return f"dvc-{pid}-{start_time}"
        pid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    return None


def _find_or_create_parent(params: Params, name: str) -> str:
    explicit = os.environ.get(PARENT_ENV)
    if explicit:
        return explicit
    key = _dvc_session_key()
    if key is not None:
        found = mlflow.search_runs(filter_string=f"tags.`arlflow.session` = '{key}'", max_results=1,
                                   output_format="list")
        if found:
            return found[0].info.run_id
    with mlflow.start_run(run_name="dvc-repro" if key else name,
                          tags={"arlflow.kind": "pipeline", "arlflow.session": key or "none"}) as run:
        mlflow.log_params(flat_params(params))
    return run.info.run_id


@contextmanager
def pipeline_run(layout: Layout, params: Params) -> Iterator[str]:
    """The parent run of one `arlflow pipeline` invocation; stage runs started inside nest under it."""
    configure(layout, params.pipeline.experiment)
    with mlflow.start_run(run_name="pipeline", tags={"arlflow.kind": "pipeline"}) as run:
        mlflow.log_params(flat_params(params))
        os.environ[PARENT_ENV] = run.info.run_id
        try:
            yield run.info.run_id
        finally:
            os.environ.pop(PARENT_ENV, None)


@contextmanager
def stage_run(layout: Layout, params: Params, stage: str, round_index: int | None) -> Iterator[str]:
    """A nested run for one stage, under the active pipeline run or the dvc-repro session's parent run."""
    label = stage if round_index is None else f"{stage}_{round_index}"
    tags = {"arlflow.kind": "stage", "stage": stage, "round": str(round_index if round_index is not None else "")}
    if mlflow.active_run() is not None:
        with mlflow.start_run(run_name=label, nested=True, tags=tags) as run:
            mlflow.log_params(flat_params(params))
            yield run.info.run_id
        return
    configure(layout, params.pipeline.experiment)
    parent = _find_or_create_parent(params, f"stage:{label}")
    with mlflow.start_run(run_id=parent):
        with mlflow.start_run(run_name=label, nested=True, tags=tags) as run:
            mlflow.log_params(flat_params(params))
            yield run.info.run_id


def register_policy(model: Any, tokenizer: Any, name: str, tags: dict[str, str]) -> str | None:
    """Log the policy as an MLflow transformers model in the active run and register a new version of `name`."""
    if mlflow.active_run() is None:
        return None
    info = mlflow.transformers.log_model(transformers_model={"model": model, "tokenizer": tokenizer}, name="policy",
                                         task="text-generation", registered_model_name=name,
                                         pip_requirements=["transformers>=5", "torch"])
    version = str(info.registered_model_version)
    client = mlflow.MlflowClient()
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    return version


def set_champion(name: str, round_tag: str) -> str | None:
    """Point the `champion` alias at the registered version whose `round` tag is round_tag (latest such)."""
    client = mlflow.MlflowClient()
    versions = [v for v in client.search_model_versions(f"name = '{name}'") if v.tags.get("round") == round_tag]
    if not versions:
        return None
    best = max(versions, key=lambda v: int(v.version))
    client.set_registered_model_alias(name, "champion", best.version)
    return str(best.version)
