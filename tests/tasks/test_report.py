"""The results text `arlflow pipeline` prints and Prefect shows, from hand-written metrics files."""
import json

import pytest

from tasks.layout import Layout
from tasks.report import markdown_table, policy_rows, results_table, skill_changes, validate_summary


def summary(rate: float, episodes: int = 10) -> dict:
    return {"success_rate": rate, "mean_return": rate - 0.5, "episodes": episodes, "mean_steps": 3.0}


EVALUATION = {
    "heldout_scenarios": 10, "seed": 3,
    "heldout": {"base": summary(0.0), "warmstart": summary(0.2), "final": summary(0.6),
                "final_with_skills": summary(0.7)},
    "rounds": {"round_10": summary(0.6), "round_2": summary(0.4), "round_1": summary(0.3)},
    "baselines": {"heldout_scenarios": 10, "seeds": [0, 1, 2], "random": {"mean": 0.1, "std": 0.02},
                  "heuristics": {"down_right_rule": {"mean": 0.5, "std": 0.0, "rule": "..."}},
                  "train_lookup": {"mean": 0.05, "std": 0.01}, "best_heuristic": {"name": "down_right_rule",
                                                                                 "mean": 0.5},
                  "final_above_every_baseline": True},
    "skills": {"live_skills": 2, "candidates": 1, "rejected": 3, "success_with_skills": 0.7,
               "success_without_skills": 0.6, "success_gain": 0.1, "skill_prompt_tokens_per_episode": 41.5},
}
TRANSFER = {"models": {"llama_warmstart": {"without_skills": summary(0.25), "with_skills": summary(0.5),
                                           "carry_over": {"success_gain": 0.25}}},
            "pretrained": {"smollm2-135m-instruct": {"without_skills": summary(0.0, 4),
                                                     "with_skills": summary(0.0, 4),
                                                     "carry_over": {"success_gain": 0.0}, "scenarios": 4}}}


@pytest.fixture
def layout(tmp_path, monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "metrics").mkdir()
    return Layout(tmp_path)


def table_rows(text: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                               for line in text.splitlines() if line.startswith("| "))}


def test_every_policy_then_the_baselines_with_their_spread(layout):
    assert [row["policy"] for row in policy_rows(EVALUATION)] == [
        "base", "warmstart", "round_1", "round_2", "round_10", "final (round_10)", "final_with_skills",
        "baseline: random", "baseline: down_right_rule", "baseline: train_lookup"]
    layout.evaluate_metrics.write_text(json.dumps(EVALUATION))
    text = results_table(layout)
    rows = table_rows(text)
    assert rows["warmstart"] == ["0.200", "-0.300", "10"]
    assert rows["final (round_10)"] == ["0.600", "0.100", "10"]
    assert rows["baseline: random"] == ["0.100 ± 0.020", "-", "30"]   # 10 scenarios x 3 seeds
    assert "held-out success (10 scenarios, seed 3)" in text
    assert "Final policy above every baseline: yes (best heuristic: down_right_rule 0.500)." in text
    # the agent with its bank is judged too, where evaluate.json says
    both = EVALUATION | {"baselines": EVALUATION["baselines"] | {"final_above_every_baseline": False,
                                                                "final_with_skills_above_every_baseline": True}}
    layout.evaluate_metrics.write_text(json.dumps(both))
    assert ("Final policy above every baseline: no; with its final skill bank: yes "
            "(best heuristic: down_right_rule 0.500).") in results_table(layout)
    assert ("Skills: 2 live, 1 candidate(s), 3 rejected; held-out success 0.700 with them vs 0.600 without "
            "(gain +0.100); 41.5 skill prompt tokens per episode.") in text
    assert "metrics/transfer.json not found: run `dvc repro transfer`" in text


def test_transfer_models_and_where_to_look_next(layout):
    layout.evaluate_metrics.write_text(json.dumps(EVALUATION))
    layout.transfer_metrics.write_text(json.dumps(TRANSFER))
    text = results_table(layout, pool_url="postgresql://arl:secret@db:5432/pool")
    rows = table_rows(text)
    assert rows["llama_warmstart"] == ["0.250", "0.500", "+0.250"]
    assert rows["smollm2-135m-instruct (pretrained, 4 scenarios)"] == ["0.000", "0.000", "+0.000"]
    root = layout.root
    assert f"mlflow ui --backend-store-uri sqlite:///{root}/mlflow.db" in text
    assert f"export PREFECT_HOME={root}/.prefect\nprefect flow-run ls" in text
    assert f"cd {root} && dvc metrics show" in text
    assert (f"arlflow gateway serve --policy {root}/artifacts/policies/round_10 "
            "--pool-url postgresql://arl:***@db:5432/pool --allow-no-auth") in text
    assert "secret" not in text


def test_a_running_prefect_server_and_mlflow_server_are_named(layout, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    text = results_table(layout)
    assert "prefect flow-run ls; prefect artifact ls   # the UI: http://127.0.0.1:4200\n" in text
    assert "PREFECT_HOME" not in text and "# MLflow: the runs are at http://mlflow:5000" in text
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere/mlflow.db")  # set by MLflow once configured
    assert "mlflow ui --backend-store-uri sqlite:///elsewhere/mlflow.db --workers 1" in results_table(layout)


@pytest.mark.parametrize("content, line", [
    (None, "metrics/evaluate.json not found: run `dvc repro evaluate` (or `arlflow pipeline`)."),
    ("{\"heldout\": ", "metrics/evaluate.json unreadable (JSONDecodeError"),
])
def test_a_missing_or_broken_evaluate_json_is_one_line(layout, content, line):
    if content is not None:
        layout.evaluate_metrics.write_text(content)
    text = results_table(layout)
    assert line in text and "### Where to look next" in text and "| " not in text


def test_baselines_that_failed_and_an_older_file_without_skills(layout):
    layout.evaluate_metrics.write_text(json.dumps({**EVALUATION, "skills": {},
                                                   "baselines": {"error": "env call failed"}}))
    text = results_table(layout)
    assert "Baselines: none this run (env call failed)." in text
    assert "Skills: no skill report in evaluate.json." in text
    assert "baseline:" not in text


def test_markdown_table_columns_line_up():
    lines = markdown_table(["a", "bb"], [["long value", 1], ["x", 22222]]).splitlines()
    assert len({len(line) for line in lines}) == 1 and lines[1] == "|" + "-" * 12 + "|" + "-" * 7 + "|"


def test_the_data_gate_report_shows_the_failed_run_when_there_is_one(layout):
    report = layout.round_metrics(2, "validate_report")
    report.parent.mkdir(parents=True)
    result = {"name": "", "expectation_type": "expect_column_values_to_be_between", "column": "reward",
              "success": True, "unexpected_count": 0}
    report.write_text(json.dumps({"success": True, "row_count": 40, "message": "", "results": [result]}))
    layout.round_metrics(2, "validate").write_text(json.dumps(
        {"steps_in": 40, "steps_out": 30, "groups_dropped": 2, "groups_total": 8, "failed_trajectories": 1,
         "curated_excluded_trajectories": 0}))
    text = validate_summary(layout, 2)
    assert text.startswith("## Data gate, round 2: passed\n\n1 expectations over 40 steps.")
    assert "Steps kept for training: 30 of 40 (2 of 8 groups dropped" in text
    assert table_rows(text)["expect_column_values_to_be_between"] == ["reward", "ok", "0"]

    report.with_name("validate_report.failed.json").write_text(json.dumps(
        {"success": False, "row_count": 40, "message": "", "data_docs": "data_docs.failed/validations/run.html",
         "results": [{**result, "name": "reward range", "success": False, "unexpected_count": 7}]}))
    text = validate_summary(layout, 2)
    assert text.startswith("## Data gate, round 2: FAILED") and "Steps kept" not in text
    assert f"Data Docs (great-expectations): file://{report.parent}/data_docs.failed/validations/run.html" in text
    assert table_rows(text)["reward range"] == ["reward", "FAILED", "7"]
    assert "validate_report.json not found: run `dvc repro validate_1`" in validate_summary(layout, 1)


def test_the_skill_changes_of_one_round(layout):
    bank = layout.skills(2)
    bank.mkdir(parents=True)
    (bank / "CHANGELOG.md").write_text("round 0: mined 3\nadded a v1 {}\nround 1: mined 1\nrejected a v1 {}\n"
                                       "round 2: mined 2; 1 live\npromoted b v1 {\"u\": 0.2}\n\n")
    text = skill_changes(layout, 2)
    assert text.startswith("## Skill bank, round 2\n\nround 2: mined 2; 1 live\n\n```\npromoted b v1")
    assert "rejected a v1" not in text and str(bank / "CHANGELOG.md") in text
    assert "CHANGELOG.md not found: run `dvc repro mine_3`" in skill_changes(layout, 3)
