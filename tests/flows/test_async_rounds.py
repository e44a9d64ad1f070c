"""Asynchronous rounds (pipeline.max_staleness, issue 17): the DAG that dvc.yaml declares, the same graph read by
DVC itself and by the pipeline flow (Prefect task runs wait on exactly those stages), rollout_{r+1} running
alongside train_r under Prefect with k = 1 and strictly one stage at a time with k = 0. The stages are stand-ins
that record when they ran: the scheduling is what is under test (the stage math: tests/models/test_off_policy.py,
the real stages with k = 1: tests/tasks/test_async_stages.py)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

import flows.pipeline as pipeline
from flows.dvc_sync import render_dvc_yaml, stage_dependencies
from tasks.config import params_to_dict, parse_params
from tasks.layout import Layout, behaviour_round

DVC = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "dvc"


def params_for(rounds: int, k: int):
    return parse_params({"pipeline": {"rounds": rounds, "seed": 3, "experiment": "Async_Probe", "max_staleness": k}})


def test_the_behaviour_round_by_hand():
    # k = 0: the previous round's policy (round 1 samples with the warm start = round 0)
    assert [behaviour_round(r, 0) for r in (1, 2, 3, 4)] == [0, 1, 2, 3]
    # k = 1: one round older, never before the warm start; staleness (r - 1) - behaviour = min(k, r - 1)
    assert [behaviour_round(r, 1) for r in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [behaviour_round(r, 2) for r in (1, 2, 3, 4)] == [0, 0, 0, 1]
    with pytest.raises(ValueError):
        behaviour_round(0, 1)
    with pytest.raises(ValueError, match="max_staleness"):
        parse_params({"pipeline": {"max_staleness": -1}})


def test_with_k_0_each_rollout_waits_for_the_previous_train_and_with_k_1_it_does_not(tmp_path):
    sync = stage_dependencies(params_for(3, 0), Layout(tmp_path))
    lagged = stage_dependencies(params_for(3, 1), Layout(tmp_path))
    assert "train_1" in sync["rollout_2"] and "train_2" in sync["rollout_3"]
    assert "train_1" not in lagged["rollout_2"] and "warmstart" in lagged["rollout_2"]
    assert "train_2" not in lagged["rollout_3"] and "train_1" in lagged["rollout_3"]
    # training still chains: train_r starts from round r-1's policy in both
    assert "train_1" in lagged["train_2"] and "train_2" in lagged["train_3"]
    # only the rollout deps differ
    assert {n for n in sync if sorted(sync[n]) != sorted(lagged[n])} == {"rollout_2", "rollout_3"}


@pytest.mark.parametrize("k", [0, 1])
def test_dvc_reads_the_same_graph_from_dvc_yaml(tmp_path, k):
    params = params_for(3, k)
    layout = Layout(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params_to_dict(params)))
    (tmp_path / "dvc.yaml").write_text(render_dvc_yaml(params, layout))
    subprocess.run([str(DVC), "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    from dvc.repo import Repo

    previous = Path.cwd()
    os.chdir(tmp_path)
    try:
        with Repo(str(tmp_path)) as repo:
            dvc_edges = {(a.addressing, b.addressing) for a, b in repo.index.graph.edges}
    finally:
        os.chdir(previous)
    ours = {(name, upstream) for name, ups in stage_dependencies(params, layout).items() for upstream in ups}
    assert dvc_edges == ours


# --- the pipeline flow under Prefect ------------------------------------------------------------------------------


def recording_stage(spans: dict, fail: str | None = None, overlap: threading.Event | None = None):
    """A stand-in for execute_stage: every stage records (start, end). With ``overlap``, train_1 holds on until
    rollout_2 has started (at most 60 s): it is set only when the two run at the same time."""
    lock = threading.Lock()
    rollout_2_started = threading.Event()

    def execute_stage(stage, round_index, params, layout):
        name = stage if round_index is None else f"{stage}_{round_index}"
        start = time.monotonic()
        if name == fail:
            raise RuntimeError(f"{name} broke")
        if name == "rollout_2":
            rollout_2_started.set()
        if name == "train_1" and overlap is not None and rollout_2_started.wait(timeout=60):
            overlap.set()
        time.sleep(0.5 if stage in ("rollout", "train") else 0.05)
        with lock:
            spans[name] = (start, time.monotonic())
        return {}

    return execute_stage


@pytest.fixture
def probe(tmp_path, monkeypatch, stand_in_stages):
    def make(k: int, fail: str | None = None, overlap: threading.Event | None = None):
        params = params_for(2, k)
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params_to_dict(params)))
        spans: dict = {}
        stand_in_stages(recording_stage(spans, fail, overlap), lambda name: name != "curate")
        monkeypatch.setattr(pipeline.report, "results_table", lambda layout, url: "| table |")
        monkeypatch.setattr(pipeline, "publish_results", lambda params, layout, table: None)
        return params, spans

    return make


@pytest.mark.slow
def test_k_1_runs_the_next_rollout_alongside_train_and_prefect_shows_the_dvc_graph(tmp_path, probe, prefect_harness):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterFlowRunId

    overlap = threading.Event()
    params, spans = probe(1, overlap=overlap)
    result = pipeline.pipeline_flow(root=str(tmp_path))
    assert result["skipped"] == ["curate"] and "rollout_2" in result["ran"]
    rollout_2, train_1, train_2 = spans["rollout_2"], spans["train_1"], spans["train_2"]
    assert overlap.is_set() and rollout_2[0] < train_1[1]                   # rollout_2 began while train_1 ran
    assert train_2[0] >= max(train_1[1], rollout_2[1])                      # train_2 waited for both
    graph = stage_dependencies(params, Layout(tmp_path))
    for name, upstream in graph.items():                                    # nothing started before its deps ended
        for dep in upstream:
            if name in spans and dep in spans:
                assert spans[name][0] >= spans[dep][1], (name, dep)

    with get_client(sync_client=True) as client:
        run, = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["Async_Probe-seed3"])))
        tasks = [t for t in client.read_task_runs(task_run_filter=TaskRunFilter(
            flow_run_id=TaskRunFilterFlowRunId(any_=[run.id]))) if t.name in graph]
    by_id = {t.id: t.name for t in tasks}
    assert sorted(by_id.values()) == sorted(graph)
    edges = {t.name: sorted(by_id[i.id] for i in t.task_inputs.get("wait_for", [])) for t in tasks}
    assert edges == {name: sorted(upstream) for name, upstream in graph.items()}
    states = {t.name: t.state.name for t in tasks}
    assert states["curate"] == "Skipped" and states["train_2"] == "Completed"


@pytest.mark.slow
def test_k_0_runs_one_stage_at_a_time_in_pipeline_order(tmp_path, probe, prefect_harness):
    _, spans = probe(0)
    pipeline.pipeline_flow(root=str(tmp_path))
    ordered = sorted(spans.values())
    assert all(earlier[1] <= later[0] for earlier, later in zip(ordered, ordered[1:]))
    assert [name for name, _ in sorted(spans.items(), key=lambda kv: kv[1])] == [
        "bootstrap", "warmstart", "rollout_1", "validate_1", "mine_1", "train_1", "rollout_2", "validate_2",
        "mine_2", "train_2", "evaluate", "transfer"]


@pytest.mark.slow
def test_k_1_a_failed_stage_fails_the_pipeline_and_its_dependents_never_start(tmp_path, probe, prefect_harness):
    _, spans = probe(1, fail="rollout_2")
    with pytest.raises(RuntimeError, match="rollout_2 broke"):
        pipeline.pipeline_flow(root=str(tmp_path))
    assert "train_1" in spans                                               # independent of rollout_2: finished
    assert not {"validate_2", "mine_2", "train_2", "evaluate", "transfer"} & set(spans)


def test_check_params_sees_max_staleness_in_dvc_yaml(tmp_path):
    """A dvc.yaml rendered for k = 0 is refused once params.yaml says k = 1 (the rollout deps differ)."""
    from flows.dvc_sync import check_dvc_yaml

    layout = Layout(tmp_path)
    (tmp_path / "dvc.yaml").write_text(render_dvc_yaml(params_for(2, 0), layout))
    check_dvc_yaml(params_for(2, 0), layout)
    with pytest.raises(RuntimeError, match="max_staleness = 1"):
        check_dvc_yaml(dataclasses.replace(params_for(2, 1)), layout)
