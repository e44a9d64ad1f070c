"""`arlflow pool ...` (flows.pool_cli.pool_app) on a SQLite pool: ls with filters, show, export/import, stats."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from datapool.records import StepRecord, TrajectoryRecord
from datapool.store import DataPool
from flows.pool_cli import pool_app

runner = CliRunner()


def traj(tid: str, *, env: str = "frozenlake", round: int = 1, retokenized: bool = False) -> TrajectoryRecord:
    steps = [StepRecord(trajectory_id=tid, group_id="g", step_index=k, prompt_ids=[1, 2, 3], response_ids=[4, 5],
                        logprobs=[-0.1, -0.2], prompt_text="p", observation="o", action=f"move {k}",
                        response_text="r", reward=0.5 * k, anchor="", policy_version="v1",
                        retokenized=retokenized and k == 1) for k in range(2)]
    return TrajectoryRecord(trajectory_id=tid, group_id="g", scenario="{}", env=env, split="train", round=round,
                            policy_version="v1", status="complete", episode_return=0.5, won=True, num_steps=2,
                            response_tokens=4, steps=steps)


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    with DataPool(url) as pool:
        pool.add_trajectories([traj("a"), traj("b", env="maze", round=2, retokenized=True)])
        pool.curate("b", step_index=1, excluded=True, label="bad-ids")
    return url


def run(*args: str):
    result = runner.invoke(pool_app, list(args))
    return result


def test_ls_lists_and_filters(url: str) -> None:
    out = run("ls", "--url", url)
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].split()[:3] == ["trajectory_id", "group_id", "env"] and len(lines) == 3
    assert "bad-ids" in out.output and "retokenized" in out.output
    only_maze = run("ls", "--url", url, "--env", "maze")
    assert [line.split()[0] for line in only_maze.output.splitlines()[1:]] == ["b"]
    assert run("ls", "--url", url, "--round", "1", "--json").output.count('"trajectory_id"') == 1
    flagged = json.loads(run("ls", "--url", url, "--flag", "retokenized", "--json").output)
    assert [r["trajectory_id"] for r in flagged] == ["b"]
    assert "no trajectories match" in run("ls", "--url", url, "--label", "nothing").output
    bad = run("ls", "--url", url, "--flag", "weird")
    assert bad.exit_code == 2 and "valid flags" in bad.output


def test_show_prints_steps_with_flags(url: str) -> None:
    out = run("show", "b", "--url", url)
    assert out.exit_code == 0, out.output
    assert "trajectory b" in out.output and "env maze" in out.output
    step_line = next(line for line in out.output.splitlines() if line.startswith("1 "))
    assert "retokenized,excluded" in step_line and "bad-ids" in step_line and "move 1" in step_line
    record = json.loads(run("show", "a", "--url", url, "--json").output)
    assert record["steps"][1]["response_ids"] == [4, 5] and record["curation"]["trajectory"] is None
    missing = run("show", "ghost", "--url", url)
    assert missing.exit_code == 1 and "unknown trajectory 'ghost'" in missing.output


def test_export_import_round_trip_and_stats(url: str, tmp_path: Path) -> None:
    path = tmp_path / "out" / "steps.parquet"
    out = run("export", str(path), "--url", url, "--round", "2")
    assert out.exit_code == 0 and "wrote 2 steps" in out.output
    assert "wrote 3 steps" in run("export", str(tmp_path / "kept.parquet"), "--url", url, "--drop-excluded").output
    copy = tmp_path / "copy.db"
    assert "imported 1 new trajectories" in run("import", str(path), "--url", str(copy)).output
    assert "imported 0 new trajectories" in run("import", str(path), "--url", str(copy)).output
    stats = json.loads(run("stats", "--url", str(copy)).output)
    assert stats["trajectories"] == 1 and stats["steps"] == 2 and stats["excluded_steps"] == 1
    assert stats["retokenized_steps"] == 1 and stats["by_env"] == {"maze": 1}


def test_missing_pool_and_bad_file_are_clear_errors(tmp_path: Path) -> None:
    out = run("stats", "--url", str(tmp_path / "none.db"))
    assert out.exit_code == 2 and "no data pool at" in out.output
    assert not (tmp_path / "none.db").exists()
    bad = run("import", str(tmp_path / "nope.parquet"), "--url", str(tmp_path / "p.db"))
    assert bad.exit_code == 2 and "nope.parquet missing" in bad.output
