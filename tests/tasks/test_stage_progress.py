"""What the stages show and record while they run, on a tiny config: the SFT and RL curves per optimizer step in
MLflow (`sft.*`, `rl.*`), the stage log lines, and evaluation bars named by the policy."""
from __future__ import annotations

import json
import logging
import math
import os

import mlflow
import pytest

from flows.stages import run_stage_functions
from models.ds_engine import LrSchedule
from tasks.common import evaluate_policy, load_engine, read_scenarios
from tasks.config import parse_params
from tasks.layout import Layout
from tasks.tracking import configure
from test_no_data_loss import TINY as NO_DATA_LOSS_TINY

pytestmark = pytest.mark.slow  # runs four stages

# test_no_data_loss's tiny project, with mini-batches small enough that warmstart and train take several updates,
# each under a cosine schedule (warmup, then a decay the stage sizes by its own updates)
COSINE = {"lr_schedule": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1}
TINY = {**NO_DATA_LOSS_TINY, "warmstart": {"demo_scenarios": 16, "update": {"epochs": 1, "micro_batch_size": 8},
                                           "optimizer": {"lr": 1e-3, **COSINE}},
        "train": {"update": {"micro_batch_size": 16, "epochs": 1}, "optimizer": {"lr": 1e-4, **COSINE}}}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def tracked_round(tmp_path_factory):
    """warmstart -> rollout_1 -> validate_1 -> train_1 inside one active MLflow run (SQLite in the project), with the
    `arlflow` loggers at INFO as the stage flows set them; the layout, params, run id and log records."""
    params, layout = parse_params(TINY), Layout(tmp_path_factory.mktemp("progress"))
    run_stage_functions(params, layout, include=("bootstrap",))
    previous_uri, stage_loggers = mlflow.get_tracking_uri(), logging.getLogger("arlflow")
    previous_level, lines = stage_loggers.level, Lines()
    stage_loggers.setLevel(logging.INFO)
    stage_loggers.addHandler(lines)
    user_uri = os.environ.pop("MLFLOW_TRACKING_URI", None)  # an earlier test's store would win over the project's
    try:
        configure(layout, "progress")
        with mlflow.start_run() as run:
            run_stage_functions(params, layout, include=("warmstart", "rollout", "validate", "train"))
    finally:
        stage_loggers.removeHandler(lines)
        stage_loggers.setLevel(previous_level)
        mlflow.set_tracking_uri(previous_uri)
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        if user_uri is not None:
            os.environ["MLFLOW_TRACKING_URI"] = user_uri
    return layout, params, run.info.run_id, lines.records


def test_sft_and_rl_log_one_point_per_optimizer_step(tracked_round):
    layout, _, run_id, _ = tracked_round
    client = mlflow.MlflowClient(layout.mlflow_uri)
    for name, metrics_file in (("sft.loss", layout.metrics_dir / "warmstart.json"),
                               ("rl.loss", layout.round_metrics(1, "train"))):
        updates = json.loads(metrics_file.read_text())["updates"]
        history = client.get_metric_history(run_id, name)
        assert updates > 1 and len(history) == updates, (name, updates, len(history))
        assert [m.step for m in history] == list(range(1, int(updates) + 1)), name
        assert all(math.isfinite(m.value) for m in history), name
    for name in ("rl.grad_norm", "rl.entropy", "rl.tokens_per_s", "sft.grad_norm"):
        assert client.get_metric_history(run_id, name), name


def test_a_cosine_schedule_decays_over_exactly_the_updates_of_the_stage(tracked_round):
    """warmstart and train size the cosine schedule by their own optimizer steps (UpdateConfig.optimizer_steps),
    before the engine exists: every update runs at the schedule's rate for its step, and the last one at the end of
    the decay. (Without a size, `lr_schedule: cosine` failed both stages.)"""
    layout, params, run_id, _ = tracked_round
    client = mlflow.MlflowClient(layout.mlflow_uri)
    for name, metrics_file, optimizer in (("sft.lr", layout.metrics_dir / "warmstart.json", params.warmstart.optimizer),
                                          ("rl.lr", layout.round_metrics(1, "train"), params.train.optimizer)):
        updates = int(json.loads(metrics_file.read_text())["updates"])
        assert updates > optimizer.warmup_steps + 2, (name, updates)
        used = [m.value for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]
        schedule = LrSchedule("cosine", optimizer.warmup_steps, updates, optimizer.min_lr_ratio)
        assert used == pytest.approx([optimizer.lr * schedule(k) for k in range(updates)], rel=1e-6), name
        assert used[-1] < optimizer.lr * (optimizer.min_lr_ratio + 0.1)           # decayed to near the floor


def test_stages_say_what_they_train_and_how_it_went(tracked_round):
    layout, _, _, records = tracked_round
    train = json.loads(layout.round_metrics(1, "train").read_text())
    by_logger: dict[str, list[str]] = {}
    for record in records:
        by_logger.setdefault(record.name, []).append(record.getMessage())
    assert any(f"= {int(train['updates'])} optimizer updates" in m for m in by_logger["arlflow.train"])
    assert any(f"{int(train['updates'])} updates, loss {train['loss']:.4f}" in m for m in by_logger["arlflow.train"])
    assert any("SFT on" in m for m in by_logger["arlflow.warmstart"])
    assert any("loss" in m and "->" in m for m in by_logger["arlflow.warmstart"])


def test_evaluation_bars_are_named_by_the_policy(tracked_round, capsys):
    layout, params, _, _ = tracked_round
    engine = load_engine(layout.policy("round_1"), "round_1", "train_1")
    _, trajectories = evaluate_policy(engine, read_scenarios(layout, "heldout"), params, label="round_1")
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert bar.startswith("evaluate round_1: 100%") and "4/4" in bar, bar
    won, steps = sum(t.won for t in trajectories), sum(t.num_steps for t in trajectories)
    assert f"won={won}" in bar and f"steps={steps}" in bar, bar
