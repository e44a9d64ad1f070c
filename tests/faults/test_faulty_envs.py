"""Envs that raise or hang in ~10 % of resets and steps (envs/faulty.py around FrozenLake: 5 % raise, 5 % hang
longer than harness.step_timeout_s): rollout and evaluate finish, each failed episode is recorded (status "failed"
and the error, in the pool and in the stage metrics), and the round trains on the rest.

Bootstrap and warm start play the env outside the rollout loop (tokenizer corpus, expert demonstrations), so they
run with the faults off; the faults are switched on in params.yaml for the stages under test, each run as its own
process (``arlflow stage ...``, conftest.StageProcesses).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
import pytest
import yaml

from datapool.parquet import read_steps
from datapool.store import DataPool
from flows.stages import run_stage_functions
from tasks.config import params_to_dict, parse_params
from tasks.layout import Layout
from test_stage_kills import TINY

FAULTS = {"raise_rate": 0.05, "hang_rate": 0.05, "hang_s": 1.5, "fault_seed": 0}
STEP_TIMEOUT_S = 0.5
INNER = {"size": 4, "p_frozen": 0.8, "max_steps": 6, "is_slippery": False, "invalid_penalty": 0.1}
TIMED_OUT = f"timed out after {STEP_TIMEOUT_S:g} s"


def config(faults: dict) -> dict:
    """The kill suite's tiny round on FrozenLake wrapped by the faulty env, with a short step timeout."""
    return {**TINY, "env": {"name": "faulty", "kwargs": {"faulty": {"inner": "frozenlake", "inner_kwargs": INNER,
                                                                     **faults}}},
            "harness": {"step_timeout_s": STEP_TIMEOUT_S}, "rollout": {"scenarios_per_round": 6, "group_size": 4}}


def write_params(root: Path, faults: dict) -> None:
    (root / "params.yaml").write_text(yaml.safe_dump(params_to_dict(parse_params(config(faults))), sort_keys=False))


@pytest.fixture(scope="module")
def clean_round(tmp_path_factory) -> Path:
    """A finished round on the faulty env with its faults off (the stage functions, in this process)."""
    root = tmp_path_factory.mktemp("faulty-env")
    write_params(root, {})
    run_stage_functions(parse_params(config({})), Layout(root),
                        include=("bootstrap", "warmstart", "rollout", "validate", "mine", "train"))
    return root


def copy_with_faults(clean_round: Path, target: Path) -> Layout:
    shutil.copytree(clean_round, target)
    write_params(target, FAULTS)
    return Layout(target)


def stage_metrics(root: Path, stage: str) -> dict[str, float]:
    """The numeric metrics MLflow holds for the latest run of ``stage`` in the project's store."""
    client = mlflow.MlflowClient(tracking_uri=Layout(root).mlflow_uri)
    experiment = client.get_experiment_by_name("arlflow")
    runs = client.search_runs([experiment.experiment_id], f"tags.stage = '{stage}'", order_by=["start_time DESC"])
    return runs[0].data.metrics


@pytest.fixture(scope="module")
def faulted_rollout(stages, clean_round, tmp_path_factory) -> dict:
    """rollout_1 rerun with the faults on (other params: new trajectory ids beside the clean round's)."""
    layout = copy_with_faults(clean_round, tmp_path_factory.mktemp("faulted") / "project")
    done = stages.run(layout.root, "rollout", 1)
    assert done.exit == 0, f"rollout_1 did not finish on a faulty env: {done.log.read_text()[-3000:]}"
    attempt = read_steps(layout.steps(1))[1]["attempt"]
    with DataPool(layout.pool_url) as pool:
        trajectories = pool.trajectories_frame(round=1)
    return {"layout": layout, "metrics": json.loads(layout.round_metrics(1, "rollout").read_text()),
            "trajectories": trajectories[trajectories["trajectory_id"].str.startswith(f"{attempt}/")],
            "wall_s": done.wall_s}


@pytest.mark.slow
def test_a_faulty_env_fails_only_its_episodes_and_the_rollout_records_why(faulted_rollout):
    metrics, faulted = faulted_rollout["metrics"], faulted_rollout["trajectories"]
    failed = faulted[faulted["status"] == "failed"]
    assert len(faulted) == metrics["episodes"] == 6 * 4
    assert metrics["failed_episodes"] == len(failed) > 0, (metrics["failed_episodes"], len(failed))
    errors = failed["error"].tolist()
    raised = [e for e in errors if "InjectedFault" in e]
    hung = [e for e in errors if TIMED_OUT in e]
    assert raised and hung and len(raised) + len(hung) == len(errors), errors
    assert all(e.startswith(("env reset failed", "env step")) for e in errors), errors
    survivors = faulted[faulted["status"] != "failed"]
    assert len(survivors) > 0 and set(survivors["status"]) <= {"complete", "truncated"}
    assert stage_metrics(faulted_rollout["layout"].root, "rollout")["failed_episodes"] == len(failed)
    print(f"rollout_1 on the faulty env: {len(faulted)} episodes, {len(failed)} failed ({len(raised)} raised, "
          f"{len(hung)} hung > {STEP_TIMEOUT_S} s, {sum(e.startswith('env reset') for e in errors)} at reset), "
          f"{faulted['num_steps'].sum()} steps kept; stage {faulted_rollout['wall_s']:.1f} s")


@pytest.mark.slow
def test_a_round_with_failed_episodes_validates_trains_and_evaluates(stages, faulted_rollout):
    layout: Layout = faulted_rollout["layout"]
    validate = stages.run(layout.root, "validate", 1)
    # an episode that failed before its first step has no step row: its group is still complete to the gate
    assert validate.exit == 0, f"validate refused a round with failed episodes: {validate.log.read_text()[-3000:]}"
    metrics = json.loads(layout.round_metrics(1, "validate").read_text())
    assert metrics["failed_trajectories"] > 0 and metrics["steps_out"] == metrics["steps_in"] - \
        metrics["failed_steps"]
    rollout_failed = stage_metrics(layout.root, "rollout")["failed_episodes"]
    assert metrics["failed_trajectories"] + metrics["failed_before_first_step"] == rollout_failed
    for stage, round_index in (("mine", 1), ("train", 1), ("evaluate", None)):
        done = stages.run(layout.root, stage, round_index)
        assert done.exit == 0, f"{stage} failed after a faulty round: {done.log.read_text()[-3000:]}"
    train = json.loads(layout.round_metrics(1, "train").read_text())
    assert train["filters_steps_in"] == metrics["steps_out"] > 0 and train["rows"] > 0
    evaluation = json.loads(layout.evaluate_metrics.read_text())["heldout"]
    print(f"faulty round: validate kept {metrics['steps_out']} of {metrics['steps_in']} steps (dropped "
          f"{metrics['failed_trajectories']} failed trajectories, {metrics['failed_steps']} steps); train on "
          f"{train['rows']} rows; evaluate failed episodes {evaluation['final']['failed_episodes']} of "
          f"{evaluation['final']['episodes']} (final policy)")


@pytest.mark.slow
def test_evaluate_finishes_on_a_faulty_env_and_counts_the_failed_episodes(stages, clean_round, tmp_path):
    layout = copy_with_faults(clean_round, tmp_path / "project")
    done = stages.run(layout.root, "evaluate")
    assert done.exit == 0, f"evaluate did not finish on a faulty env: {done.log.read_text()[-3000:]}"
    report = json.loads(layout.evaluate_metrics.read_text())
    failed = {name: summary["failed_episodes"] for name, summary in report["heldout"].items()}
    assert all(summary["episodes"] == 4 for summary in report["heldout"].values())
    assert sum(failed.values()) > 0, failed
    logged = stage_metrics(layout.root, "evaluate")
    assert {name: logged[f"{name}.failed_episodes"] for name in failed} == failed
    # the baselines play the env directly (no per-episode isolation): their env error is reported, not fatal
    baselines = report["baselines"]
    assert "InjectedFault" in baselines.get("error", ""), baselines
    print(f"evaluate on the faulty env: failed episodes per policy {failed} (of 4 each); baselines: "
          f"{baselines.get('error', 'complete')}; stage {done.wall_s:.1f} s")
