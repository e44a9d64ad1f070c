"""End to end: the pipeline flow on a tiny config, under a Prefect test server, with real DVC, MLflow, DeepSpeed, GX;
and the finished run shared through an S3 remote (SeaweedFS) into a fresh clone that reproduces it. The pipeline
runs once for the module (~200 s): `finished` is its project."""
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import mlflow
import pytest
import yaml
from safetensors.torch import load_file

from tasks.config import parse_params
from tasks.layout import Layout
from tests.projects import make_project, stage_env

REPO = Path(__file__).resolve().parents[2]
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


def weights(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, prefect_harness) -> Iterator[tuple[Layout, dict]]:
    """The tiny pipeline, run once: its project and the flow's result."""
    from flows.pipeline import pipeline_flow

    root = tmp_path_factory.mktemp("pipeline")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        layout = make_project(root, TINY)
        yield layout, pipeline_flow(root=str(root))


@pytest.mark.slow
def test_a_finished_run_pushed_to_s3_reproduces_in_a_fresh_clone(finished, s3_server, s3_bucket, tmp_path_factory):
    """`arlflow remote add` + push of the run to SeaweedFS, `git clone` + pull elsewhere: the clone is in sync with
    the remote, `dvc repro` reruns only the always-changed curate, whose snapshots come out the same (the data
    pool is not in DVC and not in the clone; the run curated nothing), and evaluate on the pulled policies gives the
    run's held-out numbers. Evaluate needs nothing outside DVC: MLflow starts an empty store in the clone."""
    layout, _ = finished
    root = layout.root
    aws = {k: v for k, v in s3_server.env().items() if k.startswith("AWS_")}
    env = stage_env(DVC_NO_ANALYTICS="1", **aws)
    env.pop("MLFLOW_TRACKING_URI", None)  # the pipeline in this process exported the original's store

    def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
        return done

    remote = [sys.executable, "-m", "flows.remote_cli"]
    dvc = [str(Path(sys.executable).parent / "dvc")]
    run(root, *remote, "add", f"s3://{s3_bucket}/runs/tiny", "--endpoint", s3_server.endpoint)
    started = time.monotonic()
    run(root, *remote, "push")
    push_s = time.monotonic() - started
    objects = [o for page in s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
               for o in page.get("Contents", [])]
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "tiny run"],
                   cwd=root, check=True)
    # beside the original: this test project's dvc.yaml lists the code it runs from (this checkout) as ../ paths,
    # which resolve the same from there (a user's project is the checkout itself: its code paths move with it)
    clone = tmp_path_factory.mktemp("clone")
    subprocess.run(["git", "clone", "-q", str(root), str(clone)], check=True)
    assert not (clone / "data").exists() and not (clone / "mlflow.db").exists()
    started = time.monotonic()
    run(clone, *remote, "pull")
    pull_s = time.monotonic() - started
    print(f"\npushed {len(objects)} objects, {sum(o['Size'] for o in objects) / 1e6:.1f} MB in {push_s:.1f} s; "
          f"pulled in {pull_s:.1f} s")

    assert json.loads(run(clone, *dvc, "status", "-c", "--json").stdout) == {}
    assert json.loads(run(clone, *dvc, "status", "--json").stdout) == {"curate": ["always changed"]}
    repro = run(clone, *dvc, "repro")
    assert re.findall(r"Running stage '(\w+)'", repro.stdout) == ["curate"], repro.stdout[-3000:]
    assert json.loads(run(clone, *dvc, "status", "--json").stdout) == {"curate": ["always changed"]}

    run(clone, str(Path(sys.executable).parent / "arlflow"), "stage", "evaluate")
    original = json.loads(layout.evaluate_metrics.read_text())
    cloned = json.loads((clone / "metrics" / "evaluate.json").read_text())
    assert cloned["heldout"] == original["heldout"] and cloned["rounds"] == original["rounds"]
    assert (clone / "metrics" / "summary.json").read_text() == layout.summary_metrics.read_text()


@pytest.mark.slow
def test_pipeline_flow_end_to_end(finished):
    from flows.pipeline import pipeline_flow

    layout, result = finished
    root = layout.root
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
    status = subprocess.run([dvc, "status", "--json"], cwd=root, capture_output=True, text=True)
    assert json.loads(status.stdout) == {"curate": ["always changed"]}, status.stdout
    again = pipeline_flow(root=str(root))
    assert again["ran"] == ["curate"]

    # a train parameter change makes only train and what depends on it stale; `dvc repro` reruns just those,
    # through `arlflow stage ...` (the same stage functions), under one MLflow parent run for the repro
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["train"]["optimizer"]["lr"] = 0.002
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = stage_env()
    stale = subprocess.run([dvc, "status", "--json"], cwd=root, capture_output=True, text=True, env=env)
    assert set(json.loads(stale.stdout)) == {"curate", "train_1"}, stale.stdout  # downstream shows once train's
    # outs change
    repro = subprocess.run([dvc, "repro"], cwd=root, capture_output=True, text=True, env=env)
    assert repro.returncode == 0, repro.stdout[-3000:] + repro.stderr[-3000:]
    assert "Running stage 'train_1'" in repro.stdout and "Running stage 'evaluate'" in repro.stdout
    assert "Running stage 'rollout_1'" not in repro.stdout and "Running stage 'transfer'" not in repro.stdout
    status = subprocess.run([dvc, "status", "--json"], cwd=root, capture_output=True, text=True, env=env)
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
    curate.run(parse_params(yaml.safe_load((root / "params.yaml").read_text())), layout)
    stale = subprocess.run([dvc, "status", "--json"], cwd=root, capture_output=True, text=True, env=env)
    assert {"curate", "validate_1"} <= set(json.loads(stale.stdout)) and "rollout_1" not in stale.stdout
