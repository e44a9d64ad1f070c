"""MLflow tracking: one parent run per pipeline run, one nested run per stage (tags: stage, round).

The store defaults to SQLite under the project (mlflow.db) with artifacts in mlartifacts/, re-rooted when the project
folder moved (relocate_store); MLFLOW_TRACKING_URI overrides it, e.g. a tracking server (infra/mlflow-server.sh) that
keeps artifacts in S3 and proxies them, so clients need no storage keys.
Under `arlflow pipeline` the parent run is opened by the first stage that runs (an invocation that runs nothing
leaves no run). Under `dvc repro` every stage is its own process: they share one parent run per `dvc repro`
invocation (found by the dvc process that launched them).

Every run carries the params (credentials masked) and the git commit and dirty flag of the project. A stage run
adds system metrics, its data inputs (dvc.yaml deps under data/) as MLflow datasets named by path with DVC's md5 as
digest, and its small outputs (dvc.yaml outs under metrics/ and the skill banks) as artifacts; evaluate and
transfer put theirs on the parent run too, with the headline numbers (metrics/summary.json) as its metrics.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import yaml
from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.sources import LocalArtifactDatasetSource
from mlflow.entities import Metric
from mlflow.environment_variables import MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from mlflow.utils.file_utils import local_file_uri_to_path
from sqlalchemy.engine import make_url

from datapool.store import masked_url
from datapool.writability import sqlite_file
from tasks.config import Params, params_to_dict
from tasks.layout import Layout, workspace_root

PARENT_ENV = "ARLFLOW_MLFLOW_PARENT_RUN_ID"
SESSION_ENV = "ARLFLOW_MLFLOW_SESSION"
_OPENING_PARENT = threading.Lock()
"""Held while a stage looks for its parent run and opens it if absent (stages of one process may run in threads)."""
# The experiment kind (a model-training experiment, not GenAI), as MLflow's UI sets it when a user picks one. MLflow
# 3.17's UI opens experiments by its sidebar switch instead (?workflowType=machine_learning: the README's link).
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
SYSTEM_METRICS_INTERVAL_S = 2.0  # MLflow's default, 10 s, leaves most stages of a small run without a sample
# a URL query parameter that carries a credential (`?api_key=...`, `&token=...`, `X-Amz-Signature=...`)
SECRET_QUERY = re.compile(r"([?&][^=&#]*(?:key|token|secret|password|signature|credential)[^=&#]*=)[^&#]*",
                          re.IGNORECASE)
REPORT_ROOTS = ("metrics/", "artifacts/skills/")  # small outputs logged as artifacts: reports, plots, skill banks
RESULT_STAGES = ("evaluate", "transfer")  # their reports go on the parent run too


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


_exported_uri: str | None = None
"""The project store configure() last selected: set_tracking_uri exports it as MLFLOW_TRACKING_URI, and a value
equal to it is ours, not the user's (another project configured in the same process must get its own store)."""


def configure(layout: Layout, experiment: str) -> str:
    """Point MLflow at the project's store (unless MLFLOW_TRACKING_URI is set), select the experiment, return the
    store's URI. A new experiment's artifacts go where its store finds them from any working directory (MLflow's
    default is ./mlruns of the working directory): a SQLite store's into mlartifacts/ beside its file (the project
    store's into the project's mlartifacts/, re-rooted by relocate_store once the project moved); a tracking server
    picks its own (mlflow-artifacts:/, proxied to its --artifacts-destination), as does any other store.
    set_tracking_uri exports MLFLOW_TRACKING_URI, so the project store is told apart by its URI, not by that.
    `dvc exp run --temp` and queued experiments run in a copy of the repository that DVC deletes afterwards: their
    runs go to the workspace's store (tasks.layout.workspace_root), as their data pools do."""
    global _exported_uri
    layout = Layout(workspace_root(layout.root, os.environ))
    exported = os.environ.get("MLFLOW_TRACKING_URI")
    chosen_by_user = exported if exported and exported != _exported_uri else None
    uri = chosen_by_user or layout.mlflow_uri
    database = _sqlite_file(uri)
    project_store = database == layout.mlflow_db.resolve()
    if project_store:
        create_sqlite_store(layout.mlflow_db, layout.mlflow_artifacts.absolute().as_uri())
        relocate_store(layout)
    mlflow.set_tracking_uri(uri)
    if chosen_by_user is None:
        _exported_uri = uri
    if mlflow.get_experiment_by_name(experiment) is None:
        folder = layout.mlflow_artifacts.absolute() if project_store else database and database.with_name("mlartifacts")
        mlflow.create_experiment(experiment, artifact_location=folder.as_uri() if folder else None)
    chosen = mlflow.set_experiment(experiment)
    if EXPERIMENT_KIND_TAG not in chosen.tags:  # new, or made before this tag (a kind chosen in the UI is kept)
        mlflow.MlflowClient().set_experiment_tag(chosen.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return uri


def _sqlite_file(uri: str) -> Path | None:
    """The database file of a SQLite store URI, resolved as SQLAlchemy opens it (against the working directory);
    None for any other store and an in-memory one."""
    file = sqlite_file(make_url(uri)) if uri.startswith("sqlite:") else None
    return file.resolve() if file else None


# MLflow 3's columns holding an artifact location (a file: URI in a local store)
ARTIFACT_LOCATION_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                             ("logged_models", "artifact_location"), ("model_versions", "source"),
                             ("model_versions", "storage_location"))


def relocate_store(layout: Layout) -> Path | None:
    """Re-root the project store after the project folder was moved or copied; return the old root (None when the
    store is where it was made). MLflow keeps every location absolute: a SQL store resolves a relative artifact
    location against the working directory as it creates the experiment (``resolve_uri_if_local``), runs and
    logged models derive theirs from it, and a relative one would be read against the opener's working directory,
    not the project. The store's Default experiment records where the store was made (create_sqlite_store put it
    at mlartifacts/0); when that is not this project's mlartifacts/, every artifact location and every local
    dataset source under the old root moves to the new one, in one transaction."""
    expected = f"{layout.mlflow_artifacts.absolute().as_uri()}/0"
    with closing(sqlite3.connect(layout.mlflow_db, timeout=60, isolation_level=None)) as db:
        if _moved_from(db, expected) is None:
            return None
        db.execute("BEGIN IMMEDIATE")  # concurrent stages: the first re-roots, the others then find it done
        recorded = _moved_from(db, expected)
        if recorded is None:
            db.execute("ROLLBACK")
            return None
        old_uri, new_uri = recorded.removesuffix("mlartifacts/0"), f"{layout.root.absolute().as_uri()}/"
        for table, column in ARTIFACT_LOCATION_COLUMNS:
            db.execute(f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE substr({column}, 1, ?) = ?",
                       (new_uri, len(old_uri) + 1, len(old_uri), old_uri))
        old_root = Path(local_file_uri_to_path(old_uri))
        for dataset, text in db.execute("SELECT dataset_uuid, dataset_source FROM datasets "
                                        "WHERE dataset_source_type = 'local'").fetchall():
            source = json.loads(text)
            if Path(source.get("uri", "")).is_relative_to(old_root):
                source["uri"] = str(layout.root.absolute() / Path(source["uri"]).relative_to(old_root))
                db.execute("UPDATE datasets SET dataset_source = ? WHERE dataset_uuid = ?",
                           (json.dumps(source), dataset))
        db.execute("COMMIT")
    return old_root


def _moved_from(db: sqlite3.Connection, expected: str) -> str | None:
    """The Default experiment's location when the store was made by create_sqlite_store elsewhere, else None."""
    row = db.execute("SELECT artifact_location FROM experiments WHERE experiment_id = 0").fetchone()
    recorded = row[0] if row else None
    return recorded if recorded and recorded != expected and recorded.endswith("/mlartifacts/0") else None


def flat_params(params: Params) -> dict[str, Any]:
    """One MLflow param per config key (``section.key``), with the credentials a URL may carry masked (a pool URL's
    password, an API key in a query). Keys themselves are never params: the config names the variables holding
    them (``engine.api_key_env``)."""
    return {f"{section}.{key}": _masked(value) for section, values in params_to_dict(params).items()
            for key, value in values.items()}


def _masked(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _masked(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_masked(item) for item in value]
    return SECRET_QUERY.sub(r"\1***", masked_url(value)) if isinstance(value, str) else value


def git_tags(root: Path) -> dict[str, str]:
    """The commit the project is at (``mlflow.source.git.commit``, as MLflow names it) and whether tracked files
    differ from it (``arlflow.git.dirty``); none outside a git checkout, before its first commit or without git.
    No optional locks: a status check must not make the user's own git command fail on index.lock."""
    git = ["git", "--no-optional-locks", "-C", str(root)]
    try:
        commit, status = (subprocess.run(git + args, capture_output=True, text=True, timeout=30)
                          for args in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"]))
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if commit.returncode or status.returncode:
        return {}
    dirty = "true" if status.stdout.strip() else "false"
    return {"mlflow.source.git.commit": commit.stdout.strip(), "arlflow.git.dirty": dirty}


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, prefix: str = "") -> None:
    """Log the finite numeric entries of metrics to the active run (no-op without one); nested mappings (e.g.
    ``per_env``) are logged with dotted names (``per_env.household.success_rate``)."""
    if mlflow.active_run() is None:
        return
    numeric = _numeric(metrics, prefix)
    if numeric:
        mlflow.log_metrics(numeric, step=step)


def _numeric(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    return {name: float(value) for name, value in _flatten(metrics, prefix).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))}


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


def _session_parent(key: str) -> str | None:
    """The parent run of the pipeline or dvc-repro invocation ``key`` in the current experiment, if opened yet."""
    found = mlflow.search_runs(filter_string=f"tags.`arlflow.session` = '{key}'", max_results=1,
                               output_format="list")
    return found[0].info.run_id if found else None


def _find_or_create_parent(layout: Layout, params: Params, name: str) -> str:
    """The parent run a stage run nests under; stages running at once (pipeline.max_staleness >= 1) open one."""
    explicit = os.environ.get(PARENT_ENV)
    if explicit:
        return explicit
    pipeline = os.environ.get(SESSION_ENV)
    key = pipeline or _dvc_session_key()
    with _OPENING_PARENT:
        if key is not None and (found := _session_parent(key)) is not None:
            return found
        tags = {"arlflow.kind": "pipeline", "arlflow.session": key or "none", **git_tags(layout.root)}
        with mlflow.start_run(run_name="pipeline" if pipeline else "dvc-repro" if key else name, tags=tags) as run:
            mlflow.log_params(flat_params(params))
    return run.info.run_id


@dataclass
class ParentRun:
    """The parent run of one `arlflow pipeline` invocation: ``run_id`` is None until a stage opens it, and stays
    None when no stage ran."""
    session: str
    run_id: str | None = None

    def __str__(self) -> str:
        return self.run_id or "none (no stage ran)"


@contextmanager
def pipeline_run(layout: Layout, params: Params) -> Iterator[ParentRun]:
    """The parent run of one `arlflow pipeline` invocation: the first stage run inside opens it (found by the
    session key in the environment, by stages in this process or started from it), so an invocation whose stages
    were all fresh leaves no empty run; it ends FAILED if the pipeline raised."""
    configure(layout, params.pipeline.experiment)
    parent = ParentRun(f"pipeline-{uuid.uuid4().hex}")
    os.environ[SESSION_ENV] = parent.session
    status = "FAILED"
    try:
        yield parent
        status = "FINISHED"
    finally:
        os.environ.pop(SESSION_ENV, None)
        parent.run_id = _session_parent(parent.session)
        if parent.run_id is not None:
            mlflow.MlflowClient().set_terminated(parent.run_id, status)


def _label(stage: str, round_index: int | None) -> str:
    return stage if round_index is None else f"{stage}_{round_index}"


def _system_metrics() -> bool | None:
    """Log system metrics (CPU, memory, disk, network; GPU with pynvml) where psutil is installed, every
    SYSTEM_METRICS_INTERVAL_S; MLflow's MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING and MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
    override both. The sampler is a thread MLflow stops when the run ends; its four INFO lines a run are muted."""
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    if MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.get() is None:
        mlflow.set_system_metrics_sampling_interval(SYSTEM_METRICS_INTERVAL_S)
    if "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING" in os.environ:
        return None  # start_run reads it
    return importlib.util.find_spec("psutil") is not None


@contextmanager
def stage_run(layout: Layout, params: Params, stage: str, round_index: int | None) -> Iterator[str]:
    """A nested run for one stage, under the active run, the pipeline's parent run or the dvc-repro session's."""
    label = _label(stage, round_index)
    tags = {"arlflow.kind": "stage", "stage": stage, "round": str(round_index if round_index is not None else ""),
            **git_tags(layout.root)}
    outer = nullcontext()
    if mlflow.active_run() is None:
        configure(layout, params.pipeline.experiment)
        outer = mlflow.start_run(run_id=_find_or_create_parent(layout, params, f"stage:{label}"))
    with outer, mlflow.start_run(run_name=label, nested=True, tags=tags,
                                 log_system_metrics=_system_metrics()) as run:
        mlflow.log_params(flat_params(params))
        yield run.info.run_id


def _dvc_stage(layout: Layout, stage: str, round_index: int | None) -> dict[str, Any]:
    """The stage's entry in the project's dvc.yaml (empty without one): the lineage the inputs and outputs logged
    here are read from, so they are exactly the deps and outs DVC tracks."""
    path = layout.root / "dvc.yaml"
    stages = yaml.safe_load(path.read_text()).get("stages", {}) if path.exists() else {}
    return stages.get(_label(stage, round_index), {})


def _paths(entries: list[Any]) -> list[str]:
    """dvc.yaml lists a path as a string, or as a one-key mapping when it has options (``{path: {cache: false}}``)."""
    return [entry if isinstance(entry, str) else next(iter(entry)) for entry in entries]


def _locked_outs(layout: Layout) -> dict[str, dict[str, Any]]:
    """dvc.lock's record (md5, size, nfiles) of every stage output, by path."""
    path = layout.root / "dvc.lock"
    stages = (yaml.safe_load(path.read_text()) or {}).get("stages", {}) if path.exists() else {}
    return {out["path"]: out for stage in stages.values() for out in stage.get("outs", [])}


def dvc_digest(path: Path, locked: Mapping[str, Any] | None) -> str:
    """The data version of path as DVC names it: a file's md5 (what dvc.lock records for it); a directory's md5
    from dvc.lock while its size and file count still match the record, else an md5 of its listing (relative
    names, sizes, modification times), which changes whenever a file does."""
    if path.is_file():
        digest = hashlib.md5()
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()
    files = sorted(p for p in path.rglob("*") if p.is_file())
    stats = [f.stat() for f in files]
    if locked and locked.get("nfiles") == len(files) and locked.get("size") == sum(s.st_size for s in stats):
        return str(locked["md5"])
    listing = "".join(f"{f.relative_to(path).as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}\n"
                      for f, stat in zip(files, stats))
    return hashlib.md5(listing.encode()).hexdigest()


def log_stage_inputs(layout: Layout, stage: str, round_index: int | None) -> None:
    """The stage's data inputs (its dvc.yaml deps under data/) as datasets of the active run: name = the path,
    digest = its DVC md5 (dvc_digest), context = the stage; MLflow lists them on the run and links the runs that
    read the same version."""
    paths = [p for p in _paths(_dvc_stage(layout, stage, round_index).get("deps", [])) if p.startswith("data/")]
    present = [p for p in paths if (layout.root / p).exists()]
    if mlflow.active_run() is None or not present:
        return
    locked = _locked_outs(layout)
    datasets = [MetaDataset(LocalArtifactDatasetSource(str(layout.root / p)), name=p,
                            digest=dvc_digest(layout.root / p, locked.get(p))) for p in present]
    mlflow.log_inputs(datasets, contexts=[stage] * len(datasets), tags_list=[None] * len(datasets))


def stage_reports(layout: Layout, stage: str, round_index: int | None) -> list[Path]:
    """The stage's small outputs, present on disk: its dvc.yaml outs and metrics under REPORT_ROOTS (JSON reports,
    rounds.csv, a skill bank with its changelog) and a validate round's Data Docs; never data or weights."""
    spec = _dvc_stage(layout, stage, round_index)
    paths = [layout.root / p for p in _paths(spec.get("outs", []) + spec.get("metrics", []))
             if p.startswith(REPORT_ROOTS)]
    if stage == "validate":
        paths.append(layout.data_docs(round_index))
    return [p for p in dict.fromkeys(paths) if p.exists()]


def log_stage_outputs(layout: Layout, stage: str, round_index: int | None) -> None:
    """The stage's reports (stage_reports) as artifacts of the active stage run, under their project paths; after
    evaluate and transfer on the parent run too, with the headline numbers (metrics/summary.json) as the parent's
    metrics, so the runs table and chart view compare pipeline runs by their results."""
    run = mlflow.active_run()
    if run is None:
        return
    client = mlflow.MlflowClient()
    parent = run.data.tags.get("mlflow.parentRunId")
    targets = [run.info.run_id] + ([parent] if parent and stage in RESULT_STAGES else [])
    for path in stage_reports(layout, stage, round_index):
        folder = path.relative_to(layout.root)
        for run_id in targets:
            if path.is_dir():
                client.log_artifacts(run_id, str(path), folder.as_posix())
            else:
                client.log_artifact(run_id, str(path), folder.parent.as_posix() if folder.parent.parts else None)
    if parent and stage == "evaluate" and layout.summary_metrics.exists():
        numeric = _numeric(json.loads(layout.summary_metrics.read_text()))
        timestamp = int(time.time() * 1000)
        client.log_batch(parent, metrics=[Metric(k, v, timestamp, 0) for k, v in numeric.items()])


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
