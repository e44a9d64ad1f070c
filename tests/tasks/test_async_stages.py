"""The real stages under pipeline.max_staleness (issue 17), on the tiny config of test_no_data_loss:

- k = 0 is bit-identical to the pipeline before asynchronous rounds existed: the same 2 rounds run by the code of
  BEFORE_ASYNC (extracted with `git archive`, run in a subprocess) write the same warm-start, round 1 and round 2
  policy bytes;
- k = 1: rollout_2 samples with the warm start, every one of its steps records policy version and staleness 1,
  train_2 trains from round 1's policy and logs the importance weights of its stale rows; the pipeline flow, which
  runs those stages concurrently under Prefect, writes the same policies as the stages run one after the other.
The scheduling (DVC graph, Prefect overlap) is tests/flows/test_async_rounds.py; the math tests/models/test_off_policy.
"""
from __future__ import annotations

import json
import shutil
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.stages import run_stage_functions
from tasks.config import parse_params
from tasks.layout import Layout
from tests.projects import make_project, stage_env
from tests.tasks.test_no_data_loss import TINY, digest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BEFORE_ASYNC = "946527d"   # main before pipeline.max_staleness: the reference for "k = 0 changes nothing"
STAGES = ("bootstrap", "warmstart", "rollout", "validate", "mine", "train")
POLICIES = ("warmstart", "round_1", "round_2")
OLD_CODE_RUN = """
import json, sys
from pathlib import Path
import flows.stages
from flows.stages import run_stage_functions
from tasks.config import parse_params
from tasks.layout import Layout
params, root = parse_params(json.loads(sys.argv[1])), Path(sys.argv[2])
run_stage_functions(params, Layout(root), include=tuple(sys.argv[3].split(",")))
print(flows.stages.__file__)
"""


def tiny(k: int | None) -> dict:
    """The tiny config with 2 rounds; k None leaves max_staleness out (BEFORE_ASYNC's params know no such key).
    Every value whose default changed since BEFORE_ASYNC is spelled out, so both codes train with the same values."""
    staleness = {} if k is None else {"max_staleness": k}
    train = {**TINY["train"], "optimizer": {"lr": 1e-4}}    # BEFORE_ASYNC's default lr was 3e-4
    return {**TINY, "pipeline": {**TINY["pipeline"], "rounds": 2, **staleness}, "train": train}


def old_code(tmp: Path) -> Path | None:
    """BEFORE_ASYNC's tree under tmp/code, or None when this clone's history lacks it (a shallow checkout)."""
    found = subprocess.run(["git", "cat-file", "-e", f"{BEFORE_ASYNC}^{{commit}}"], cwd=REPO, capture_output=True)
    if found.returncode != 0:
        return None
    archive = subprocess.run(["git", "archive", BEFORE_ASYNC], cwd=REPO, capture_output=True, check=True).stdout
    code = tmp / "code"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(code, filter="data")
    return code


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """k = 0 with this code (and, alongside in a subprocess, with BEFORE_ASYNC's), then round 2 again with k = 1
    from a copy of the k = 0 project after round 1 (round 1 does not depend on k)."""
    tmp = tmp_path_factory.mktemp("async_stages")
    code = old_code(tmp)
    before = None
    if code is not None:
        (tmp / "before").mkdir()
        env = stage_env(PYTHONPATH=str(code))   # not this process's torch.distributed group (its MASTER_PORT)
        before = subprocess.Popen([sys.executable, "-c", OLD_CODE_RUN, json.dumps(tiny(None)), str(tmp / "before"),
                                   ",".join(STAGES)], cwd=code, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    sync = tmp / "sync"
    sync.mkdir()
    run_stage_functions(parse_params(tiny(0)), Layout(sync), include=STAGES)

    lagged = tmp / "lagged"
    shutil.copytree(sync, lagged)
    for stage_output in (Layout(lagged).steps(2), Layout(lagged).policy("round_2")):
        shutil.rmtree(stage_output) if stage_output.is_dir() else stage_output.unlink()
    run_stage_functions(parse_params(tiny(1)), Layout(lagged), include=("rollout", "validate", "mine", "train"),
                        start_round=2)
    result = {"sync": Layout(sync), "lagged": Layout(lagged), "before": None, "code": code}
    if before is not None:
        out, err = before.communicate(timeout=900)
        assert before.returncode == 0, err[-3000:]
        assert Path(out.strip().splitlines()[-1]).is_relative_to(code)     # the old code ran, not this checkout's
        result["before"] = Layout(tmp / "before")
    return result


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_k_0_writes_the_same_policies_as_the_pipeline_before_async_rounds(runs):
    if runs["before"] is None:
        pytest.skip(f"this checkout's history lacks {BEFORE_ASYNC} (shallow clone): nothing to compare with")
    sync, before = runs["sync"], runs["before"]
    assert {name: digest(sync.policy(name)) for name in POLICIES} == {
        name: digest(before.policy(name)) for name in POLICIES}
    new, old = read(sync.round_metrics(2, "train")), read(before.round_metrics(2, "train"))
    assert new["loss"] == old["loss"] and new["grad_norm"] == old["grad_norm"]
    assert new["stale_row_fraction"] == 0.0 and new["is_weight_mean"] == 1.0 and new["steps_staleness_0"] > 0


def test_k_0_rollouts_sample_the_previous_round_and_record_staleness_0(runs):
    sync = runs["sync"]
    for r, version in [(1, "warmstart"), (2, "round_1")]:
        metrics = read(sync.round_metrics(r, "rollout"))
        assert (metrics["policy_version"], metrics["staleness"]) == (version, 0)
        steps = pq.read_table(sync.steps(r), columns=["policy_version", "staleness"]).to_pydict()
        assert set(steps["policy_version"]) == {version} and set(steps["staleness"]) == {0}


def test_k_1_rollout_2_samples_the_warm_start_and_train_2_corrects_its_stale_rows(runs):
    lagged, sync = runs["lagged"], runs["sync"]
    rollout = read(lagged.round_metrics(2, "rollout"))
    assert (rollout["policy_version"], rollout["staleness"]) == ("warmstart", 1)
    steps = pq.read_table(lagged.steps(2), columns=["policy_version", "staleness"]).to_pydict()
    assert set(steps["policy_version"]) == {"warmstart"} and set(steps["staleness"]) == {1}
    # round 1 is shared: the same policy bytes whatever k
    assert digest(lagged.policy("round_1")) == digest(sync.policy("round_1"))

    train = read(lagged.round_metrics(2, "train"))
    cap = parse_params(tiny(1)).train.loss.is_weight_cap
    assert train["stale_row_fraction"] == 1.0 and train["staleness_max"] == 1.0
    assert train["steps_staleness_1"] == len(steps["staleness"]) and "steps_staleness_0" not in train
    assert 0.0 < train["is_weight_mean"] <= train["is_weight_max"] <= cap
    assert 0.0 <= train["is_weight_truncated_fraction"] <= 1.0
    # the weights are not all 1: train_2's proximal policy (round 1) differs from the behaviour policy (warm start)
    assert train["is_weight_max"] != 1.0 and train["logp_mismatch_max"] > 1e-3
    assert digest(lagged.policy("round_2")) != digest(sync.policy("round_2"))


def test_k_1_under_prefect_writes_the_same_policies_as_the_stages_run_in_sequence(runs, tmp_path, prefect_harness,
                                                                                  monkeypatch):
    """The pipeline flow with k = 1 (stages as concurrent task runs, rollout_2 free to start beside train_1, in one
    process) against the same stage functions one after the other (what `dvc repro` runs): the same policy bytes,
    and every stage run nested under one MLflow parent run."""
    import mlflow

    from flows.pipeline import pipeline_flow
    from tasks.tracking import configure

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # the frozen SmolLM2 of the transfer stage plays no part in the policies compared here (test_real_model has it)
    layout = make_project(tmp_path / "project", {**tiny(1), "transfer": {"pretrained": []}})
    result = pipeline_flow(root=str(layout.root))
    assert {"rollout_2", "train_1", "train_2"} <= set(result["ran"])
    lagged = runs["lagged"]
    assert {name: digest(layout.policy(name)) for name in POLICIES} == {
        name: digest(lagged.policy(name)) for name in POLICIES}
    assert read(layout.round_metrics(2, "rollout"))["policy_version"] == "warmstart"

    configure(layout, parse_params(tiny(1)).pipeline.experiment)
    runs_ = mlflow.search_runs(search_all_experiments=True, output_format="list")
    parents = [r for r in runs_ if r.data.tags.get("arlflow.kind") == "pipeline"]
    stages = [r for r in runs_ if r.data.tags.get("arlflow.kind") == "stage"]
    assert len(parents) == 1 and {r.data.tags["mlflow.parentRunId"] for r in stages} == {parents[0].info.run_id}
    assert {r.info.run_name for r in stages} >= {"rollout_2", "train_1", "train_2", "evaluate"}
