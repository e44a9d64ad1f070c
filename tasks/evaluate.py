"""evaluate: held-out scenarios for the base, warm-start, every round's and the final policy (also with skills),
next to the non-learning baselines on the same scenarios (envs/baselines.py: random, the env's heuristics, a
train-memorizing lookup) and how many held-out scenarios equal a train one."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from envs.base import Scenario
from envs.baselines import baseline_report
from skills.lifecycle import CHANGE_VERBS, load_round_bank
from tasks.common import env_kwargs, evaluate_policy, read_json, read_scenarios, seed_everything, write_json
from tasks.engines import open_engine
from tasks.config import Params
from tasks.layout import Layout
from tasks.outputs import staged_outputs
from tasks.tracking import log_metrics, set_champion

SUMMARY_KEYS = ("success_rate", "mean_return", "mean_steps", "mean_response_tokens", "episodes")


def _subset(summary: dict[str, Any]) -> dict[str, Any]:
    return {key: summary[key] for key in SUMMARY_KEYS} | {k: v for k, v in summary.items() if k not in SUMMARY_KEYS}


def skill_report(without: dict[str, Any], with_skills: dict[str, Any], bank, layout: Layout,
                 rounds: int) -> dict[str, Any]:
    """Quality against cost of the final bank on the final policy (Skill_EE): success and prompt tokens with and
    without skills, the skill tokens an episode pays, and every change the bank went through (its changelog)."""
    changelog = [line for line in bank.changelog.splitlines() if line.strip()]
    per_round = []
    for r in range(1, rounds + 1):
        path = layout.round_metrics(r, "mine")
        mine = read_json(path, f"mine_{r}") if path.exists() else {}
        per_round.append({"round": r, **{verb: mine.get(verb, 0) for verb in CHANGE_VERBS},
                          "live": mine.get("live", 0), "candidates": mine.get("candidates", 0)})
    return {
        "success_without_skills": without["success_rate"], "success_with_skills": with_skills["success_rate"],
        "success_gain": with_skills["success_rate"] - without["success_rate"],
        "prompt_tokens_per_step_without_skills": without["mean_prompt_tokens"],
        "prompt_tokens_per_step_with_skills": with_skills["mean_prompt_tokens"],
        "skill_prompt_tokens_per_episode": with_skills["mean_skill_prompt_tokens"],
        "macro_calls_per_episode": with_skills["macro_calls_per_episode"],
        "live_skills": len(bank.live), "candidates": len(bank.candidates), "rejected": len(bank.rejected),
        "changes": {verb: sum(line.startswith(verb + " ") for line in changelog) for verb in CHANGE_VERBS},
        "per_round": per_round, "changelog": changelog,
    }


def summary_metrics(report: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of an evaluate report (metrics/summary.json, the one file dvc.yaml lists as metrics):
    held-out success per policy and per round, the baselines, the skills; under names that are the same every run
    and nested one level at most, so `dvc metrics show` and `dvc exp show --only-changed` stay a few columns wide.
    Everything else stays in evaluate.json. Booleans are 0/1, which DVC compares and plots as numbers."""
    heldout, skills, baselines = report["heldout"], report["skills"], report["baselines"]
    success = {policy: result["success_rate"] for policy, result in heldout.items()}
    summary: dict[str, Any] = {
        "heldout_success": success | {"final_minus_warmstart": round(success["final"] - success["warmstart"], 6)},
        "heldout_by_round": {label: result["success_rate"] for label, result in report["rounds"].items()},
        "skills": {"live": skills["live_skills"], "success_gain": round(skills["success_gain"], 6)},
    }
    if "error" not in baselines:
        summary["baselines"] = {"random": baselines["random"]["mean"],
                                "train_lookup": baselines["train_lookup"]["mean"],
                                **{name: h["mean"] for name, h in baselines["heuristics"].items()}}
        summary["final_above_every_baseline"] = int(baselines["final_above_every_baseline"])
        if "final_with_skills_above_every_baseline" in baselines:  # not in reports before it was added
            summary["final_with_skills_above_every_baseline"] = int(
                baselines["final_with_skills_above_every_baseline"])
    return summary


def write_rounds_plot(path: Path, rows: list[dict[str, Any]]) -> None:
    """rounds.csv, one row per round; the last row has every column. A row without some values (round 0 has no
    train rollout) ends before them, so they must be its last columns (a KeyError otherwise): CSV readers (DVC's
    DictReader, pandas) read them as missing, which DVC hands Vega as null and Vega leaves undrawn, where an empty
    cell would read as "" and be drawn at 0."""
    fields = list(rows[-1])
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(fields)
        writer.writerows([row[field] for field in fields[:len(row)]] for row in rows)


def baselines_or_error(heldout: list[Scenario], train: list[Scenario], kwargs_by_env: dict[str, dict[str, Any]],
                       max_turns: int = 0) -> dict[str, Any]:
    """The non-learning baselines (envs/baselines.py), or ``{"error": ...}`` when an env call raised while they
    played: they call the env directly, without the rollout loop's per-episode isolation, and a flaky env must not
    fail the stage after every policy was evaluated. ``max_turns``: harness.max_turns (0: no budget)."""
    try:
        return baseline_report(heldout, train, kwargs_by_env, max_turns=max_turns or 1000)
    except Exception as err:  # noqa: BLE001 - any env error; the report names it
        return {"error": f"a baseline's env call failed, no baselines this run: {type(err).__name__}: {err}"}


def run(params: Params, layout: Layout) -> dict[str, Any]:
    seed_everything(params.pipeline.seed)
    rounds = params.pipeline.rounds
    heldout = read_scenarios(layout, "heldout")
    final_bank = load_round_bank(layout.skills(rounds))
    final_skills = final_bank.live
    policies = [("base", "base", "bootstrap"), ("warmstart", "warmstart", "warmstart")]
    policies += [(f"round_{r}", f"round_{r}", f"train_{r}") for r in range(1, rounds + 1)]

    results: dict[str, dict[str, Any]] = {}
    handoffs: dict[str, dict[str, Any]] = {}
    for label, folder, producer in policies:
        with open_engine(params, layout, layout.policy(folder), folder, producer,
                         stage=f"evaluate-{label}") as (engine, handoffs[label]):
            results[label], _ = evaluate_policy(engine, heldout, params, layout=layout, label=label)
            if label == f"round_{rounds}":
                results["final_with_skills"], _ = evaluate_policy(engine, heldout, params, layout=layout,
                                                                  skills=final_skills,
                                                                  label="final_with_skills")
                results["final_with_skills"]["skills_in_bank"] = len(final_skills)
    results["final"] = results[f"round_{rounds}"]
    heldout_metrics = {key: _subset(results[key]) for key in ("base", "warmstart", "final", "final_with_skills")}
    per_round = {f"round_{r}": _subset(results[f"round_{r}"]) for r in range(1, rounds + 1)}
    skills_report = skill_report(results["final"], results["final_with_skills"], final_bank, layout, rounds)
    baselines = baselines_or_error(heldout, read_scenarios(layout, "train"), env_kwargs(params, layout),
                                   params.harness.max_turns)
    if "error" not in baselines:
        best = max([baselines["random"]["mean"], baselines["train_lookup"]["mean"]]
                   + [h["mean"] for h in baselines["heuristics"].values()])
        # the plain policy, and the agent the pipeline ships (the policy with its final bank): where primitive
        # play cannot win a map in the decision budget, only the second can beat a rule
        baselines["final_above_every_baseline"] = results["final"]["success_rate"] > best
        baselines["final_with_skills_above_every_baseline"] = results["final_with_skills"]["success_rate"] > best
    report = {"heldout": heldout_metrics, "rounds": per_round, "skills": skills_report, "baselines": baselines,
              "heldout_scenarios": len(heldout), "seed": params.pipeline.seed, "engine": handoffs}

    rows = []
    for r in range(0, rounds + 1):
        label = "warmstart" if r == 0 else f"round_{r}"
        row = {"round": r, "heldout_success_rate": results[label]["success_rate"],
               "heldout_mean_return": results[label]["mean_return"]}
        if r > 0:  # round 0 (the warm start) had no rollout
            rollout = read_json(layout.round_metrics(r, "rollout"), f"rollout_{r}")
            row |= {"train_success_rate": rollout["success_rate"], "train_mean_return": rollout["mean_return"]}
        rows.append(row)
        log_metrics({"heldout_success_rate": results[label]["success_rate"],
                     "heldout_mean_return": results[label]["mean_return"]}, step=r)
    targets = [layout.evaluate_metrics, layout.rounds_plot, layout.summary_metrics]
    with staged_outputs(layout.root, "evaluate", targets) as out:
        write_json(out.path(layout.evaluate_metrics), report)
        write_json(out.path(layout.summary_metrics), summary_metrics(report))
        write_rounds_plot(out.path(layout.rounds_plot), rows)

    for key, summary in heldout_metrics.items():
        log_metrics(summary, prefix=f"{key}.")
    log_metrics({k: v for k, v in skills_report.items() if isinstance(v, (int, float))}, prefix="skills.")
    if "error" not in baselines:
        log_metrics({"random": baselines["random"]["mean"], "train_lookup": baselines["train_lookup"]["mean"],
                     "heldout_equal_to_a_train_scenario": baselines["heldout_equal_to_a_train_scenario"],
                     **{name: h["mean"] for name, h in baselines["heuristics"].items()}}, prefix="baseline.")
    best_round = max(range(1, rounds + 1), key=lambda r: (results[f"round_{r}"]["success_rate"], r))
    champion = set_champion(params.pipeline.registered_model, str(best_round))
    return {"heldout": heldout_metrics, "champion_round": best_round, "champion_version": champion}
