"""What DVC's own views show (issue 15): `dvc metrics show` and `dvc exp show` list only metrics/summary.json's
headline numbers, `dvc plots show` draws each curve once on named axes and no train point for round 0, and the
git-ignore rules keep dvc.lock writable by DVC. Real DVC and git, on a rendered dvc.yaml in a temporary project."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.dvc_sync import render_dvc_yaml
from tasks.common import write_json
from tasks.config import load_params
from tasks.evaluate import summary_metrics, write_rounds_plot
from tasks.layout import Layout

REPO = Path(__file__).resolve().parents[2]
DVC = str(Path(sys.executable).parent / "dvc")


def _result(success: float) -> dict[str, Any]:
    return {"success_rate": success, "mean_return": success - 0.1, "mean_steps": 5.0, "episodes": 200}


REPORT = {  # an evaluate.json of two rounds, by hand
    "heldout": {"base": _result(0.0), "warmstart": _result(0.385), "final": _result(0.635),
                "final_with_skills": _result(0.64)},
    "rounds": {"round_1": _result(0.595), "round_2": _result(0.635)},
    "skills": {"live_skills": 3, "candidates": 2, "success_gain": 0.64 - 0.635, "changelog": ["added s1 ..."],
               "per_round": [{"round": 1, "live": 1}, {"round": 2, "live": 3}]},
    "baselines": {"random": {"mean": 0.013, "std": 0.002}, "train_lookup": {"mean": 0.83, "std": 0.0},
                  "heuristics": {"down_right_rule": {"mean": 0.83, "std": 0.0, "params": {}, "rule": "..."}},
                  "final_above_every_baseline": False, "final_with_skills_above_every_baseline": False,
                  "heldout_equal_to_a_train_scenario": 0},
    "heldout_scenarios": 200, "seed": 0, "engine": {"base": {"kind": "transformers"}},
}


def _leaves(tree: dict[str, Any], depth: int = 1) -> list[tuple[str, int]]:
    """(key, depth) of every number in a nested dict."""
    return [leaf for key, value in tree.items()
            for leaf in (_leaves(value, depth + 1) if isinstance(value, dict) else [(key, depth)])]


def _dvc(root: Path, *args: str) -> str:
    done = subprocess.run([DVC, *args], cwd=root, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"DVC_NO_ANALYTICS": "1"})
    assert done.returncode == 0, f"dvc {' '.join(args)} failed:\n{done.stderr[-2000:]}"
    return done.stdout


@pytest.fixture
def project(tmp_path) -> tuple[Layout, dict[str, Any]]:
    """A two-round project: params and the rendered dvc.yaml (returned parsed)."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["pipeline"]["rounds"] = 2
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    layout = Layout(tmp_path)
    text = render_dvc_yaml(load_params(tmp_path / "params.yaml"), layout)
    (tmp_path / "dvc.yaml").write_text(text)
    return layout, yaml.safe_load(text)


@pytest.fixture
def repo(project) -> tuple[Layout, dict[str, Any]]:
    """The project as a git + DVC repository, with the repository's .gitignore."""
    root = project[0].root
    (root / ".gitignore").write_text((REPO / ".gitignore").read_text())
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    _dvc(root, "init", "-q")
    return project


def test_the_summary_is_the_only_metrics_file_and_the_reports_stay_outputs(project):
    stages = project[1]["stages"]
    metrics = {name: spec["metrics"] for name, spec in stages.items() if "metrics" in spec}
    assert metrics == {"evaluate": ["metrics/summary.json"]}
    outs = [out for spec in stages.values() for out in spec.get("outs", [])]
    reports = ["metrics/bootstrap.json", "metrics/curate.json", "metrics/warmstart.json", "metrics/evaluate.json",
               "metrics/transfer.json", "metrics/plots/rounds.csv"]
    reports += [f"metrics/rounds/round_{r}/{s}.json" for r in (1, 2) for s in ("rollout", "validate", "mine", "train")]
    assert set(reports) <= set(outs) and len(outs) == len(set(outs))
    assert not [name for name, spec in stages.items() if "plots" in spec], "plots are defined once, at the top level"


def test_summary_keys_from_a_hand_written_evaluate_report():
    assert summary_metrics(REPORT) == {
        "heldout_success": {"base": 0.0, "warmstart": 0.385, "final": 0.635, "final_with_skills": 0.64,
                            "final_minus_warmstart": 0.25},
        "heldout_by_round": {"round_1": 0.595, "round_2": 0.635},
        "skills": {"live": 3, "success_gain": 0.005},
        "baselines": {"random": 0.013, "train_lookup": 0.83, "down_right_rule": 0.83},
        "final_above_every_baseline": 0, "final_with_skills_above_every_baseline": 0,
    }
    failed = REPORT | {"baselines": {"error": "a baseline's env call failed"}}
    assert set(summary_metrics(failed)) == {"heldout_success", "heldout_by_round", "skills"}


def test_dvc_metrics_and_exp_show_list_only_the_summary(repo):
    layout, _ = repo
    write_json(layout.summary_metrics, summary_metrics(REPORT))
    write_json(layout.evaluate_metrics, REPORT)  # a full report: an output, not a metric
    write_json(layout.round_metrics(1, "train"), {f"loss_{i}": i for i in range(200)})
    shown = json.loads(_dvc(layout.root, "metrics", "show", "--json"))[""]["data"]
    assert list(shown) == ["metrics/summary.json"]
    leaves = _leaves(shown["metrics/summary.json"]["data"])
    assert len(leaves) == 14 and max(depth for _, depth in leaves) <= 2

    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run(git + ["add", "-A"], cwd=layout.root, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "project"], cwd=layout.root, check=True)
    workspace = json.loads(_dvc(layout.root, "exp", "show", "--json", "--no-pager"))[0]["data"]
    assert list(workspace["metrics"]) == ["metrics/summary.json"]


def test_dvc_plots_draw_each_curve_once_on_named_axes_without_a_train_point_at_round_0(repo):
    layout, dvc_yaml = repo
    definitions = {name: spec for plot in dvc_yaml["plots"] for name, spec in plot.items()}
    curves = [(path, field) for spec in definitions.values() for path, fields in spec["y"].items() for field in fields]
    assert len(curves) == len(set(curves)) == 4
    assert all(spec.get("x_label") and spec.get("y_label") for spec in definitions.values())

    rows = [{"round": 0, "heldout_success_rate": 0.385, "heldout_mean_return": 0.3}]
    rows += [{"round": r, "heldout_success_rate": 0.5, "heldout_mean_return": 0.4, "train_success_rate": 0.6,
              "train_mean_return": 0.55} for r in (1, 2)]
    layout.rounds_plot.parent.mkdir(parents=True)
    write_rounds_plot(layout.rounds_plot, rows)
    shown = json.loads(_dvc(layout.root, "plots", "show", "--json"))["data"]
    assert set(shown) == set(definitions), "no plot drawn twice (a stage-level `plots:` entry adds its own)"
    for name, [plot] in shown.items():
        content = plot["content"]
        assert content["encoding"]["x"]["title"] == definitions[name]["x_label"]
        assert content["layer"][0]["encoding"]["y"]["title"] == definitions[name]["y_label"] != "y"
        round_0 = {point["field"]: point["dvc_inferred_y_value"] for point in content["data"]["values"]
                   if point["round"] == "0"}
        heldout, train = definitions[name]["y"]["metrics/plots/rounds.csv"]
        assert round_0[heldout] is not None and round_0[train] is None, "null: Vega leaves it undrawn; \"\" is 0"


def test_dvc_plots_output_is_ignored_and_dvc_lock_is_not():
    """DVC refuses to write a git-ignored dvc.lock ("'dvc.lock' is git-ignored"), so the repository leaves it
    untracked (README, "dvc.lock"); dvc_plots/ is what `dvc plots show` writes."""
    ignored = lambda path: subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0  # noqa: E731
    assert ignored("dvc_plots/index.html") and not ignored("dvc.lock")
