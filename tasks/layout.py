"""Where each stage reads and writes, relative to the project root (the same paths dvc.yaml lists)."""
from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Mapping
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("arlflow.layout")


class MissingInputError(FileNotFoundError):
    """A stage input is absent: the message names the stage that produces it."""


def policy_name(round_index: int) -> str:
    """The policy a round ends with: "warmstart" for round 0, else "round_<r>"."""
    return "warmstart" if round_index == 0 else f"round_{round_index}"


def behaviour_round(round_index: int, max_staleness: int) -> int:
    """The round whose policy samples rollout of round r under staleness bound k: max(0, r - 1 - k) (k = 0: r - 1,
    the synchronous pipeline). Its staleness, the rounds it lags the policy train_r starts from, is
    ``(r - 1) - behaviour_round(r, k)`` = min(k, r - 1)."""
    if round_index < 1 or max_staleness < 0:
        raise ValueError(f"round {round_index} (>= 1), max_staleness {max_staleness} (>= 0)")
    return max(0, round_index - 1 - max_staleness)


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def scenarios_dir(self) -> Path:
        return self.root / "data" / "scenarios"

    @property
    def games_dir(self) -> Path:
        """Generated game files (textworld_cooking): part of bootstrap's scenario output, so DVC tracks them."""
        return self.scenarios_dir / "games"

    def scenarios(self, split: str) -> Path:
        return self.scenarios_dir / f"{split}.jsonl"

    def policy(self, name: str) -> Path:
        """Policy folders: base, warmstart, round_1..round_R, transfer_<arch>."""
        return self.root / "artifacts" / "policies" / name

    def round_policy(self, round_index: int) -> Path:
        """The policy train of round r starts from (and synchronous rollout of round r samples with): the warm start
        for r = 1, else round r-1's."""
        return self.policy(policy_name(round_index - 1))

    def rollout_policy(self, round_index: int, max_staleness: int = 0) -> Path:
        """The policy rollout of round r samples with: round ``behaviour_round(r, k)``'s (pipeline.max_staleness)."""
        return self.policy(policy_name(behaviour_round(round_index, max_staleness)))

    def round_dir(self, round_index: int) -> Path:
        return self.root / "data" / "rounds" / f"round_{round_index}"

    def steps(self, round_index: int) -> Path:
        return self.round_dir(round_index) / "steps.parquet"

    def validated(self, round_index: int) -> Path:
        return self.round_dir(round_index) / "validated.parquet"

    def skill_trials(self, round_index: int) -> Path:
        """Per step of a round's rollout: which half of a paired skill test it was in, and SIRI's plain prompts."""
        return self.round_dir(round_index) / "skill_trials.parquet"

    def curation(self, round_index: int) -> Path:
        """The pool's labels and exclusions of round r's trajectories (the curate stage's snapshot)."""
        return self.root / "data" / "curation" / f"round_{round_index}.parquet"

    def skills(self, round_index: int) -> Path:
        return self.root / "artifacts" / "skills" / f"round_{round_index}"

    def train_checkpoints(self, round_index: int) -> Path:
        """Resumable training state of round r (not a DVC output: removed once the round's policy is saved)."""
        return self.root / "artifacts" / "checkpoints" / f"train_{round_index}"

    @property
    def logs_dir(self) -> Path:
        """Server logs of the stages (managed vLLM servers); not DVC outputs."""
        return self.root / "logs"

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    def round_metrics(self, round_index: int, stage: str) -> Path:
        return self.metrics_dir / "rounds" / f"round_{round_index}" / f"{stage}.json"

    def data_docs(self, round_index: int) -> Path:
        """great-expectations' Data Docs site of round r's data gate (beside validate_report.json)."""
        return self.metrics_dir / "rounds" / f"round_{round_index}" / "data_docs"

    @property
    def evaluate_metrics(self) -> Path:
        return self.metrics_dir / "evaluate.json"

    @property
    def rounds_plot(self) -> Path:
        return self.metrics_dir / "plots" / "rounds.csv"

    @property
    def summary_metrics(self) -> Path:
        """The headline numbers of a run: dvc.yaml's one `metrics:` file, what `dvc metrics show` and `dvc exp show`
        list (the full reports stay in the other metrics/*.json)."""
        return self.metrics_dir / "summary.json"

    @property
    def transfer_metrics(self) -> Path:
        return self.metrics_dir / "transfer.json"

    @property
    def pool_file(self) -> Path:
        """The workspace's data pool: what `dvc repro`, `arlflow pipeline`, the gateway and `arlflow pool` use by
        default (a stage inside `dvc exp run` uses its experiment's, see `stage_pool_url`)."""
        return self.root / "data" / "pool.db"

    @property
    def pool_url(self) -> str:
        return f"sqlite:///{self.pool_file}"

    @property
    def experiment_pools_dir(self) -> Path:
        return self.root / "data" / "pools"

    def experiment_pool(self, experiment: str) -> Path:
        """The pool of one DVC experiment, `experiment` as `experiment_of` names it (NAME@BASELINE)."""
        return self.experiment_pools_dir / f"{experiment}.db"

    def find_experiment_pool(self, name: str) -> Path:
        """The pool of experiment `name` (as `dvc exp show` lists it) or `NAME@BASELINE` (its file's name); an error
        listing the experiment pools there are when none or several match."""
        pools = sorted(self.experiment_pools_dir.glob("*.db"))
        found = [p for p in pools if name in (p.stem, p.stem.rsplit("@", 1)[0])]
        if len(found) == 1:
            return found[0]
        known = ", ".join(p.stem for p in pools) or "none yet"
        raise ValueError(f"{'several experiment pools match' if found else 'no experiment pool named'} {name!r} in "
                         f"{self.experiment_pools_dir} (there: {known}): pass NAME@BASELINE as listed")

    @property
    def prefect_home(self) -> Path:
        return self.root / ".prefect"

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlflow_uri(self) -> str:
        return f"sqlite:///{self.mlflow_db}"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlartifacts"


def experiment_of(environ: Mapping[str, str]) -> str | None:
    """`NAME@BASELINE` (the baseline commit's first 7 hex digits) of the DVC experiment this process runs in, from the
    variables `dvc exp run` sets for every stage it runs, in the workspace, with --temp and from the queue alike
    (DVC_EXP_NAME, DVC_EXP_BASELINE_REV); None outside one (`dvc repro`, `arlflow pipeline`). DVC keeps names unique
    per baseline, so the pair is the experiment's identity: a rerun (`dvc exp run -f -n NAME`) is the same one."""
    name = environ.get("DVC_EXP_NAME")
    if not name:
        return None
    baseline = environ.get("DVC_EXP_BASELINE_REV", "")[:7]
    return f"{name}@{baseline}" if baseline else name


def workspace_root(root: Path, environ: Mapping[str, str]) -> Path:
    """The project's folder in the user's workspace: ``root`` itself, except in `dvc exp run --temp` and queued
    experiments, which run in a copy of the repository and name the workspace's repository in DVC_ROOT (the project
    may sit in a subfolder of it: the same one in the copy)."""
    repo = environ.get("DVC_ROOT")
    if not repo:
        return root
    copy = next((p for p in (root, *root.parents) if (p / ".dvc").is_dir()), root)
    return Path(repo) / root.relative_to(copy)


def copy_sqlite(source: Path, target: Path) -> None:
    """Copy a live SQLite pool with SQLite's online backup (a consistent snapshot while a gateway or a stage writes
    to ``source``), atomically: a copy that fails or is killed midway leaves nothing under ``target``'s name."""
    partial = target.with_name(f".{target.name}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial.unlink(missing_ok=True)
        with closing(sqlite3.connect(source, timeout=30.0)) as src, closing(sqlite3.connect(partial)) as dst:
            src.backup(dst)
        os.replace(partial, target)
    except (sqlite3.Error, OSError) as err:
        partial.unlink(missing_ok=True)
        raise OSError(f"cannot copy the data pool {source} to {target} ({type(err).__name__}: {err}): free space "
                      f"or fix {source}, then rerun the stage") from err


def stage_pool_url(layout: Layout, explicit: str = "", environ: Mapping[str, str] = os.environ, *,
                   writes: bool = True) -> str:
    """The data pool a stage uses. ``explicit`` (rollout.pool_url), when set, as it is: the user's choice, shared by
    the baseline and every experiment (a warning says so inside one). Else the workspace's data/pool.db, or inside
    `dvc exp run` the experiment's own data/pools/NAME@BASELINE.db in the workspace (for --temp and queued runs too,
    whose copy of the repository is deleted afterwards), so an experiment never adds data to the baseline's pool.

    The experiment's pool starts as a copy of the workspace's, made by its first writer (``writes``): it inherits the
    baseline's trajectories and curation as it inherits the baseline's DVC outputs, so the curate stage snapshots
    the same labels and the stages the experiment did not change stay fresh. Until then a reader (``writes=False``)
    gets the workspace's pool, and an experiment that writes nothing copies nothing."""
    experiment = experiment_of(environ)
    if explicit:
        if experiment is not None:
            log.warning("rollout.pool_url is set: experiment %s uses that pool, shared with the baseline; give it "
                        "its own with `dvc exp run -S rollout.pool_url=...`", experiment)
        return explicit
    if experiment is None:
        return layout.pool_url
    workspace = Layout(workspace_root(layout.root, environ))
    pool = workspace.experiment_pool(experiment)
    if not pool.exists():
        if not writes:
            return workspace.pool_url
        if workspace.pool_file.exists():
            copy_sqlite(workspace.pool_file, pool)
    return f"sqlite:///{pool}"


def require(path: Path, produced_by: str) -> Path:
    """Return path if it exists, else raise an error saying which stage makes it."""
    if not path.exists():
        raise MissingInputError(f"{path} missing: run `dvc repro {produced_by}` (or `arlflow pipeline`) first")
    return path
