"""End to end: the pipeline flow on a tiny config, under a Prefect test server, with real DVC, MLflow, DeepSpeed, GX."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml
from safetensors.torch import load_file

from flows.dvc_sync import render_dvc_yaml
from tasks.config import params_to_dict, parse_params
from tasks.layout import Layout

REPO = Path(__file__).resolve().parents[2]
CODE = ["envs", "agents", "models", "tasks", "skills", "datapool", "flows"]
SUMMARY_KEYS = {"success_rate", "mean_return", "mean_steps", "mean_response_tokens", "episodes"}

TINY = {
    "pipeline": {"rounds": 1, "seed": 3},
    "bootstrap": {"train_scenarios": 24, "heldout_scenarios": 8, "tokenizer_corpus_episodes": 40,
                  "tiny": {"hidden_size": 64, "intermediate_size": 128}},
    "warmstart": {"demo_scenarios": 24, "update": {"epochs": 1, "micro_batch_size": 32}},
    "rollout": {"scenarios_per_round": 6, "group_size": 4, "sampling": {"temperature": 1.0}},
    "validate": {"drop_zero_variance": False},
    "mine": {"min_support": 0.1},
    "train": {"update": {"micro_batch_size": 32, "epochs": 1}, "optimizer": {"lr": 0.001}},
    # SmolLM2 in transfer is tests/tasks/test_real_model.py's (the same pretrained_report); here it would add ~60 s
    "transfer": {"model": {"hidden_size": 64, "intermediate_size": 128}, "pretrained": []},
}


def make_project(root: Path, raw: dict) -> Layout:
    for name in CODE:
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(REPO / "infra", root / "infra")
    # DVC tracks whole sections, so the file holds every key (defaults filled in), as the repo's params.yaml does
    (root / "params.yaml").write_text(yaml.safe_dump(params_to_dict(parse_params(raw)), sort_keys=False))
    layout = Layout(root)
    (root / "dvc.yaml").write_text(render_dvc_yaml(parse_params(raw), layout))
    (root / ".dvcignore").write_text("__pycache__/\n*.pyc\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "init", "-q"], cwd=root, check=True)
    return layout


def weights(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_pipeline_flow_end_to_end(tmp_path, prefect_harness, monkeypatch):
    from flows.pipeline import pipeline_flow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    layout = make_project(tmp_path, TINY)
    result = pipeline_flow(root=str(tmp_path))
    assert result["skipped"] == []
    assert result["ran"][0] == "bootstrap" and result["ran"][-1] == "transfer"

    # the policy's parameters changed in warm start and in the RL round
    base, warm, final = (weights(layout.policy(n)) for n in ("base", "warmstart", "round_1"))
    assert any(not (base[k] == warm[k]).all() for k in base)
    assert any(not (warm[k] == final[k]).all() for k in warm)

    # the data pool holds every step of the round
    from datapool.store import DataPool
    with DataPool(layout.pool_url) as pool:
        counts = pool.counts()
    rollout = json.loads(layout.round_metrics(1, "rollout").read_text())
    assert counts["trajectories"] == 6 * 4
    assert counts["steps"] == rollout["steps"] > 0

    # skill banks (round 0 from the warm start's expert demos, round 1 from the lifecycle), the rollout's skill
    # trials, and both metrics files with the documented keys
    changelog = (layout.skills(1) / "CHANGELOG.md").read_text()
    assert changelog.startswith("round 0: mined (frequent)") and "\nround 1: mined (frequent)" in changelog
    assert layout.skill_trials(1).exists()
    rollout_tests = json.loads(layout.round_metrics(1, "rollout").read_text())["skill_tests"]
    assert rollout_tests == {"candidate": 6}, rollout_tests   # the warm start's candidates were validated
    mine_metrics = json.loads(layout.round_metrics(1, "mine").read_text())
    assert set(mine_metrics["validation"]) and mine_metrics["promoted"] + mine_metrics["rejected"] >= 1
    evaluation = json.loads(layout.evaluate_metrics.read_text())
    assert set(evaluation["heldout"]) == {"base", "warmstart", "final", "final_with_skills"}
    for summary in evaluation["heldout"].values():
        assert SUMMARY_KEYS <= set(summary)
        assert summary["episodes"] == 8
    report = evaluation["skills"]
    assert {"success_with_skills", "success_without_skills", "skill_prompt_tokens_per_episode",
            "changelog", "changes"} <= set(report)
    assert report["changelog"] == [line for line in changelog.splitlines() if line]
    transfer = json.loads(layout.transfer_metrics.read_text())
    assert len(transfer["models"]) >= 2
    for entry in transfer["models"].values():
        assert SUMMARY_KEYS <= set(entry["without_skills"]) and SUMMARY_KEYS <= set(entry["with_skills"])
    assert transfer["pretrained"] == {}
    assert all({"success_gain", "skill_prompt_tokens_per_episode"} <= set(e["carry_over"]) for e in transfer["models"].values())

    # MLflow: one parent run, a nested run per stage with metrics, the round policy registered
    client = mlflow.MlflowClient(tracking_uri=layout.mlflow_uri)
    experiment = client.get_experiment_by_name("arlflow")
    runs = client.search_runs([experiment.experiment_id])
    parent = [r for r in runs if r.data.tags.get("arlflow.kind") == "pipeline"]
    stages = [r for r in runs if r.data.tags.get("arlflow.kind") == "stage"]
    assert len(parent) == 1
    assert {r.data.tags["stage"] for r in stages} == {"bootstrap", "curate", "warmstart", "rollout", "validate",
                                                      "mine", "train", "evaluate", "transfer"}
    assert all(r.data.tags["mlflow.parentRunId"] == parent[0].info.run_id for r in stages)
    train_run = next(r for r in stages if r.data.tags["stage"] == "train")
    assert {"loss", "clip_fraction", "grad_norm"} <= set(train_run.data.metrics)
    assert client.get_model_version_by_alias("arlflow-policy", "champion").tags["round"] == "1"

    # DVC: everything is recorded; a second run only re-reads the pool's curation (the always-changed stage)
    dvc = str(Path(sys.executable).parent / "dvc")
    status = subprocess.run([dvc, "status", "--json"], cwd=tmp_path, capture_output=True, text=True)
    assert json.loads(status.stdout) == {"curate": ["always changed"]}, status.stdout
    again = pipeline_flow(root=str(tmp_path))
    assert again["ran"] == ["curate"]

    # a train parameter change makes only train and what depends on it stale; `dvc repro` reruns just those,
    # through `arlflow stage ...` (the same stage functions), under one MLflow parent run for the repro
    raw = yaml.safe_load((tmp_path / "params.yaml").read_text())
    raw["train"]["optimizer"]["lr"] = 0.002
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for inherited in ("PREFECT_API_URL", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(inherited, None)  # this test process already holds a torch.distributed group on MASTER_PORT
    stale = subprocess.run([dvc, "status", "--json"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert set(json.loads(stale.stdout)) == {"curate", "train_1"}, stale.stdout  # downstream shows once train's
    # outs change
    repro = subprocess.run([dvc, "repro"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert repro.returncode == 0, repro.stdout[-3000:] + repro.stderr[-3000:]
    assert "Running stage 'train_1'" in repro.stdout and "Running stage 'evaluate'" in repro.stdout
    assert "Running stage 'rollout_1'" not in repro.stdout and "Running stage 'transfer'" not in repro.stdout
    status = subprocess.run([dvc, "status", "--json"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert json.loads(status.stdout) == {"curate": ["always changed"]}, status.stdout
    runs = client.search_runs([experiment.experiment_id])
    repro_parent = [r for r in runs if r.info.run_name == "dvc-repro"]
    assert len(repro_parent) == 1
    nested = {r.data.tags.get("stage") for r in runs
              if r.data.tags.get("mlflow.parentRunId") == repro_parent[0].info.run_id}
    assert nested == {"curate", "train", "evaluate"}

    # an exclusion made in the pool after the round marks validate_1 stale (through the curation snapshot)
    with DataPool(layout.pool_url) as pool:
        pool.curate(pool.steps_frame(round=1)["trajectory_id"].iloc[0], excluded=True, note="looks wrong")
    from tasks import curate
    curate.run(parse_params(yaml.safe_load((tmp_path / "params.yaml").read_text())), layout)
    stale = subprocess.run([dvc, "status", "--json"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert {"curate", "validate_1"} <= set(json.loads(stale.stdout)) and "rollout_1" not in stale.stdout
