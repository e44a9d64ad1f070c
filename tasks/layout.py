"""Where each stage reads and writes, relative to the project root (the same paths dvc.yaml lists)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class MissingInputError(FileNotFoundError):
    """A stage input is absent: the message names the stage that produces it."""


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
        """The policy that rollout of round r uses: the warm start for r = 1, else round r-1's."""
        return self.policy("warmstart" if round_index == 1 else f"round_{round_index - 1}")

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
    def pool_url(self) -> str:
        return f"sqlite:///{self.root / 'data' / 'pool.db'}"

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


def require(path: Path, produced_by: str) -> Path:
    """Return path if it exists, else raise an error saying which stage makes it."""
    if not path.exists():
        raise MissingInputError(f"{path} missing: run `dvc repro {produced_by}` (or `arlflow pipeline`) first")
    return path
