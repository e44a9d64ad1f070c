"""The results a run leaves, as text people read: the held-out table with the baselines, the skill summary, the
transfer models and where to look next (what `arlflow pipeline` prints last and the Prefect artifacts show), a data
gate report and a round's skill changes. Markdown tables padded to line up in a terminal too; a missing or
unreadable file is one line saying which stage writes it, never an error."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from datapool.store import masked_url
from skills.bank import CHANGELOG_FILE
from tasks.layout import Layout

def load_json(path: Path, produced_by: str) -> tuple[dict[str, Any] | None, str]:
    """The file's JSON object, or None and the line to show instead."""
    try:
        return json.loads(path.read_text()), ""
    except FileNotFoundError:
        return None, f"{path} not found: run `dvc repro {produced_by}` (or `arlflow pipeline`)."
    except (OSError, ValueError) as err:
        return None, f"{path} unreadable ({type(err).__name__}: {err}): rerun `dvc repro {produced_by}`."


def _number(value: Any, digits: int = 3, signed: bool = False) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table whose columns are padded to a common width, so it reads the same printed or rendered."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])])


def _round_number(name: str) -> int:
    return int(name.rsplit("_", 1)[-1])


def final_round(evaluation: dict[str, Any]) -> str | None:
    """The last round's policy name (``round_R``) in evaluate.json."""
    return max(evaluation.get("rounds", {}), key=_round_number, default=None)


def policy_rows(evaluation: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per policy of evaluate.json (base, warm start, every round, final, final with skills) and per
    baseline (random, each heuristic, train_lookup: the mean success over their seeds, and its spread)."""
    heldout, rounds = evaluation.get("heldout", {}), evaluation.get("rounds", {})
    labels = {"final": f"final ({final_round(evaluation)})" if rounds else "final"}
    rows = []
    for key, summary in [*[(k, heldout[k]) for k in ("base", "warmstart") if k in heldout],
                         *sorted(rounds.items(), key=lambda item: _round_number(item[0])),
                         *[(k, heldout[k]) for k in ("final", "final_with_skills") if k in heldout]]:
        rows.append({"policy": labels.get(key, key), "success": summary.get("success_rate"),
                     "mean_return": summary.get("mean_return"), "episodes": summary.get("episodes"), "spread": None})
    baselines = evaluation.get("baselines", {})
    named = [("random", baselines.get("random")), *baselines.get("heuristics", {}).items(),
             ("train_lookup", baselines.get("train_lookup"))]
    seeds = len(baselines.get("seeds", [])) or 1
    for name, baseline in named:
        if baseline:
            rows.append({"policy": f"baseline: {name}", "success": baseline.get("mean"), "mean_return": None,
                         "episodes": baselines.get("heldout_scenarios", 0) * seeds, "spread": baseline.get("std")})
    return rows


def _policy_table(rows: list[dict[str, Any]]) -> str:
    def success(row: dict[str, Any]) -> str:
        spread = f" ± {_number(row['spread'])}" if row["spread"] is not None else ""
        return _number(row["success"]) + spread

    return markdown_table(["policy", "held-out success", "mean return", "episodes"],
                          [[r["policy"], success(r), _number(r["mean_return"]), r["episodes"] or 0] for r in rows])


def _baseline_verdict(evaluation: dict[str, Any]) -> str:
    baselines = evaluation.get("baselines", {})
    if "error" in baselines:
        return f"Baselines: none this run ({baselines['error']})."
    if "final_above_every_baseline" not in baselines:
        return "Baselines: not in evaluate.json."
    best = baselines.get("best_heuristic")
    best_text = f" (best heuristic: {best['name']} {_number(best['mean'])})" if best else ""
    def verdict(key: str) -> str:
        return "yes" if baselines.get(key) else "no"

    with_skills = (f"; with its final skill bank: {verdict('final_with_skills_above_every_baseline')}"
                   if "final_with_skills_above_every_baseline" in baselines else "")
    return f"Final policy above every baseline: {verdict('final_above_every_baseline')}{with_skills}{best_text}."


def _skill_summary(evaluation: dict[str, Any]) -> str:
    skills = evaluation.get("skills")
    if not skills:
        return "Skills: no skill report in evaluate.json."
    return (f"Skills: {skills.get('live_skills', 0)} live, {skills.get('candidates', 0)} candidate(s), "
            f"{skills.get('rejected', 0)} rejected; held-out success {_number(skills.get('success_with_skills'))} "
            f"with them vs {_number(skills.get('success_without_skills'))} without "
            f"(gain {_number(skills.get('success_gain'), signed=True)}); "
            f"{_number(skills.get('skill_prompt_tokens_per_episode'), 1)} skill prompt tokens per episode.")


def _transfer_table(layout: Layout) -> str:
    transfer, missing = load_json(layout.transfer_metrics, "transfer")
    if transfer is None:
        return f"Transfer: {missing}"
    entries = list(transfer.get("models", {}).items())
    entries += [(f"{name} (pretrained, {entry.get('scenarios', '?')} scenarios)", entry)
                for name, entry in transfer.get("pretrained", {}).items()]
    rows = [[name, _number(e.get("without_skills", {}).get("success_rate")),
             _number(e.get("with_skills", {}).get("success_rate")),
             _number(e.get("carry_over", {}).get("success_gain"), signed=True)] for name, e in entries]
    if not rows:
        return "Transfer: no models in transfer.json."
    return "### Transfer (held-out success)\n\n" + markdown_table(
        ["model", "without skills", "with skills", "gain"], rows)


def where_to_look(layout: Layout, pool_url: str | None = None,
                  final_policy: str | None = None) -> str:
    """The commands that open this run's results: the MLflow UI, Prefect's runs, DVC's metrics, the pool's UI."""
    tracking = os.environ.get("MLFLOW_TRACKING_URI") or layout.mlflow_uri   # MLflow sets it once configured
    mlflow_line = (f"# MLflow: the runs are at {tracking}" if tracking.startswith(("http:", "https:")) else
                   f"mlflow ui --backend-store-uri {tracking} --workers 1 --port 5000   # http://127.0.0.1:5000, then the "
                   "experiment's Runs (URL ending ?workflowType=machine_learning; MLflow 3 opens on GenAI)")
    api = os.environ.get("PREFECT_API_URL")
    prefect_lines = ([] if api else [f"export PREFECT_HOME={os.environ.get('PREFECT_HOME', layout.prefect_home)}"])
    prefect_lines.append("prefect flow-run ls; prefect artifact ls   # the UI: "
                         + (api.removesuffix("/api") if api else "prefect server start -> http://127.0.0.1:4200"))
    policy = layout.policy(final_policy or "warmstart")
    lines = [mlflow_line, *prefect_lines, f"cd {layout.root} && dvc metrics show",
             f"arlflow gateway serve --policy {policy} --pool-url {masked_url(pool_url or layout.pool_url)} "
             f"--allow-no-auth   # the pool's UI at http://127.0.0.1:8000/ui"]
    return "### Where to look next\n\n```bash\n" + "\n".join(lines) + "\n```"


def results_table(layout: Layout, pool_url: str | None = None) -> str:
    """The end-of-pipeline results (markdown) from metrics/evaluate.json and metrics/transfer.json."""
    evaluation, missing = load_json(layout.evaluate_metrics, "evaluate")
    if evaluation is None:
        return f"## Results\n\n{missing}\n\n{where_to_look(layout, pool_url)}\n"
    title = (f"## Results: held-out success ({evaluation.get('heldout_scenarios', '?')} scenarios, "
             f"seed {evaluation.get('seed', '?')})")
    parts = [title, _policy_table(policy_rows(evaluation)), _baseline_verdict(evaluation), _skill_summary(evaluation),
             _transfer_table(layout), where_to_look(layout, pool_url, final_round(evaluation))]
    return "\n\n".join(parts) + "\n"


def validate_summary(layout: Layout, round_index: int) -> str:
    """The data gate's report of round r (markdown): the verdict, what was removed, and one row per expectation.
    A failed run's report (validate_report.failed.json) is shown when it exists: it is removed on success."""
    report_path = layout.round_metrics(round_index, "validate_report")
    failed_path = report_path.with_name(f"{report_path.stem}.failed.json")
    shown = failed_path if failed_path.exists() else report_path
    report, missing = load_json(shown, f"validate_{round_index}")
    if report is None:
        return f"## Data gate, round {round_index}\n\n{missing}\n"
    results = report.get("results", [])
    verdict = "passed" if report.get("success") else "FAILED"
    lines = [f"## Data gate, round {round_index}: {verdict}",
             f"{len(results)} expectations over {report.get('row_count', 0)} steps."
             + (f" {report['message']}" if report.get("message") else "")]
    metrics, _ = load_json(layout.round_metrics(round_index, "validate"), f"validate_{round_index}")
    if metrics and report.get("success"):
        lines.append(f"Steps kept for training: {metrics.get('steps_out')} of {metrics.get('steps_in')} "
                     f"({metrics.get('groups_dropped', 0)} of {metrics.get('groups_total', 0)} groups dropped for "
                     f"zero variance, {metrics.get('failed_trajectories', 0)} failed and "
                     f"{metrics.get('curated_excluded_trajectories', 0)} curated-out trajectories removed).")
    if report.get("data_docs"):  # the validation's page in great-expectations' Data Docs, beside the report
        lines.append(f"Data Docs (great-expectations): {(shown.parent / report['data_docs']).as_uri()}")
    rows = [[r.get("name") or r.get("expectation_type", "?"), r.get("column") or "-",
             "ok" if r.get("success") else "FAILED", r.get("unexpected_count", 0)] for r in results]
    if rows:
        lines.append(markdown_table(["expectation", "column", "result", "unexpected"], rows))
    return "\n\n".join(lines) + "\n"


def skill_changes(layout: Layout, round_index: int) -> str:
    """The skill bank's changes in round r (markdown): its changelog from the `round r:` header on (the file
    holds every round's lines, each round's after the previous ones)."""
    path = layout.skills(round_index) / CHANGELOG_FILE
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError:
        return f"## Skill bank, round {round_index}\n\n{path} not found: run `dvc repro mine_{round_index}`.\n"
    starts = [i for i, line in enumerate(lines) if line.startswith(f"round {round_index}:")]
    section = lines[starts[-1]:] if starts else lines
    return (f"## Skill bank, round {round_index}\n\n{section[0] if starts else 'changelog:'}\n\n```\n"
            + "\n".join(section[1:] if starts else section) + f"\n```\n\nFull changelog: {path}\n")
