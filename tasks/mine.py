"""mine: the round's skill bank. One pass of the skill lifecycle (docs/algorithms.md section 9) over the previous bank:

1. **validate**: candidates tested in this round's rollout (tasks/skill_trials.py) are promoted when u(c) > tau and
   Welch t > t_min, else rejected into ``rejected/`` with their evidence; untested ones stay candidates;
2. **credit**: live skills' utility from the paired (skill-free vs skill-guided) groups, as an EMA
   (models.skill_advantages.update_skill_utility), and when they were last shown;
3. **versions**: Thompson evidence of each skill's versions (discounted Beta updates), retirement;
4. **revise** (with an LLM miner): a live skill that failed in this round gets a revised version;
5. **prune**: by utility, by disuse, by bank size;
6. **mine**: new candidates from successful trajectories (frequent sub-sequences or MDL macros, plus the LLM miner);
   with skills.validate they wait in ``candidates/`` for the next rollout, else they go live directly.

Every change is a changelog line with its evidence; each round's bank is its own DVC-tracked folder.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pandas as pd

from datapool.parquet import read_steps
from models.skill_advantages import update_skill_utility
from skills.bank import Skill
from skills.lifecycle import BankChange, RoundBank, load_round_bank, prune_skills, save_round_bank
from skills.llm_miner import TrajectoryText, mine_llm_skills, revise_skill
from skills.llm_writers import ChatEndpointWriter, EngineWriter
from skills.miners import mine_skills
from skills.validation import decide, with_evidence
from skills.versions import SKIP, add_version, retire, to_dict, update
from tasks.common import load_engine, write_json
from tasks.config import Params
from tasks.layout import Layout, require
from tasks.outputs import staged_outputs
from tasks.skill_trials import (candidate_results, episode_table, paired_utilities, read_trials, version_label,
                                version_outcomes, version_state, with_stats)

_MACRO_ACTION = re.compile(r"^skill \d+\b")
_TASK_LINE = re.compile(r"^Task: (.*)$", re.MULTILINE)
MAX_ACTIVE_VERSIONS = 3


def successful_action_sequences(frame: pd.DataFrame) -> list[tuple[str, list[str]]]:
    """(trajectory id, actions in step order) of every won trajectory; invalid steps and macro calls stay as ""
    (they break runs: a macro's own actions are already a skill)."""
    won = frame[frame["won"].astype(bool)].sort_values(["trajectory_id", "step_index"])
    return [(str(tid), ["" if _MACRO_ACTION.match(str(a)) else str(a) for a in group["action"].tolist()])
            for tid, group in won.groupby("trajectory_id")]


def trajectory_texts(frame: pd.DataFrame, ids: list[str] | None = None) -> list[TrajectoryText]:
    """The LLM miner's view of trajectories: task, (observation, action) per step, outcome."""
    rows = frame if ids is None else frame[frame["trajectory_id"].isin(ids)]
    out = []
    for tid, steps in rows.sort_values(["trajectory_id", "step_index"]).groupby("trajectory_id", sort=True):
        match = _TASK_LINE.search(str(steps["prompt_text"].iloc[0]))
        out.append(TrajectoryText(trajectory_id=str(tid), task=match.group(1) if match else "",
                                  steps=list(zip(steps["observation"].astype(str), steps["action"].astype(str))),
                                  won=bool(steps["won"].iloc[0]), episode_return=float(steps["reward"].sum())))
    return out


def skill_writer(params: Params, layout: Layout, round_index: int):
    """The configured LLM miner: None (off), the round's policy, or an OpenAI-compatible endpoint."""
    cfg = params.skills.llm
    if not cfg.miner:
        return None
    if cfg.miner == "policy":
        engine = load_engine(layout.round_policy(round_index), f"round_{round_index}",
                             "warmstart" if round_index == 1 else f"train_{round_index - 1}")
        return EngineWriter(engine, engine.tokenizer, seed=params.pipeline.seed)
    return ChatEndpointWriter(cfg.miner, cfg.model, api_key_env=cfg.api_key_env)


def mine_candidates(frame: pd.DataFrame, params: Params, round_index: int) -> list[Skill]:
    return mine_skills(successful_action_sequences(frame), params.mine)


def lifecycle_round(previous: RoundBank, episodes: pd.DataFrame, frame: pd.DataFrame, params: Params,
                    round_index: int, writer=None) -> tuple[RoundBank, list[BankChange], dict[str, Any]]:
    """The new bank, its changes (with evidence) and metrics: steps 1-6 of the module docstring."""
    life = params.skills
    changes: list[BankChange] = []
    metrics: dict[str, Any] = {}
    live = list(previous.live)
    versions = {name: list(others) for name, others in previous.versions.items()}

    # 1. validation of the candidates this rollout tested
    names = {c.name for c in previous.candidates}
    results = {name: r for name, r in candidate_results(episodes, tau=life.validation.tau, t_min=life.validation.t_min).items()
               if name in names}
    decision = decide(previous.candidates, results)
    for skill in decision.promoted:
        record = decision.evidence[skill.name]
        live.append(with_stats(with_evidence(skill, record), utility=record["u"], round=round_index,
                               last_used_round=round_index, uses=record["n_aug"]))
        changes.append(BankChange("promoted", skill, _brief(record)))
    for skill in decision.rejected:
        changes.append(BankChange("rejected", skill, _brief(decision.evidence[skill.name])))
    candidates = list(decision.pending)
    metrics["validation"] = {name: _brief(decision.evidence[name]) for name in decision.evidence}

    # 2. paired credit of live skills, and when each was last shown
    credit = paired_utilities(episodes)
    shown = {name for names_ in (episodes["skills"] if not episodes.empty else []) for name in names_}
    updated = []
    for skill in live:
        stats = {}
        if skill.name in credit and skill.name not in results:
            gap, groups = credit[skill.name]
            old = skill.stats.get("utility")
            stats["utility"] = round(update_skill_utility(float(old), gap) if old is not None else gap, 6)
            stats["uses"] = int(skill.stats.get("uses", 0)) + groups
        if skill.name in shown:
            stats["last_used_round"] = round_index
        updated.append(with_stats(skill, **stats) if stats else skill)
    live = updated
    metrics["paired_utility"] = {name: round(gap, 6) for name, (gap, _) in credit.items()}

    # 3. versions: discounted Thompson evidence, retirement
    vcfg = life.versions
    outcomes = version_outcomes(episodes)
    for index, skill in enumerate(live):
        if skill.name not in outcomes:
            continue
        all_versions = {version_label(v): v for v in [skill, *versions.get(skill.name, [])]}
        state = version_state(skill, versions.get(skill.name, []))
        for group in outcomes[skill.name]:
            known = [(label, won) for label, won in group if label in state]
            if known:
                state = update(state, known, vcfg)
        state, retired = retire(state, vcfg)
        for label in retired:
            if label != SKIP:
                changes.append(BankChange("retired", all_versions[label], {"mean": round(state[label].mean, 4),
                                                                            "uses": state[label].uses}))
        active = [label for label, arm in state.items() if not arm.retired and label != SKIP]
        main = max(active, key=lambda label: (state[label].mean, label)) if active else version_label(skill)
        head = with_stats(all_versions[main], **{k: v for k, v in skill.stats.items() if k != "versions"},
                          versions=to_dict(state))
        live[index] = head
        versions[skill.name] = [all_versions[label] for label in sorted(active) if label != main]

    # 4. revisions of live skills that failed this round (LLM miner)
    if writer is not None and not episodes.empty:
        for index, skill in enumerate(live):
            failing = episodes[(~episodes["won"].astype(bool))
                               & episodes["skills"].apply(lambda names_, n=skill.name: n in names_)]
            if failing.empty or 1 + len(versions.get(skill.name, [])) >= MAX_ACTIVE_VERSIONS:
                continue
            texts = trajectory_texts(frame, failing["trajectory_id"].head(4).tolist())
            newest = max([skill.version] + [v.version for v in versions.get(skill.name, [])])
            revised, reason = revise_skill(writer, replace(skill, version=newest), texts, round_index=round_index)
            if revised is None:
                metrics.setdefault("revision_failures", []).append(f"{skill.name}: {reason}")
                continue
            state = add_version(version_state(skill, versions.get(skill.name, [])), version_label(revised))
            versions.setdefault(skill.name, []).append(revised)
            live[index] = with_stats(skill, versions=to_dict(state))
            changes.append(BankChange("revised", revised, {"from_failures": len(texts)}))

    # 5. pruning
    live, pruned = prune_skills(live, current_round=round_index, min_utility=life.prune.min_utility,
                                max_idle_rounds=life.prune.max_idle_rounds, max_size=life.prune.max_bank_size)
    changes.extend(pruned)
    for change in pruned:
        versions.pop(change.skill.name, None)

    # 6. new candidates
    known = {s.name for s in live} | {c.name for c in candidates} | {s.name for s in previous.rejected} | names
    mined = mine_candidates(frame, params, round_index)
    if writer is not None:
        won_ids = sorted({str(t) for t in frame.loc[frame["won"].astype(bool), "trajectory_id"]})
        llm_skills, failures = mine_llm_skills(writer, trajectory_texts(frame, won_ids[:16]), round_index=round_index,
                                               max_skills=1, existing_names=sorted(known))
        mined += llm_skills
        metrics["llm_miner_failures"] = failures
    fresh = [with_stats(s, round=round_index) for s in mined if s.name not in known][: life.max_candidates]
    for skill in fresh:
        changes.append(BankChange("added", skill, {"as": "candidate" if life.validate else "live",
                                                   **{k: skill.stats[k] for k in ("support", "count", "mdl_gain",
                                                                                   "source") if k in skill.stats}}))
    if life.validate:
        candidates += fresh
    else:
        live += fresh
    versions = {name: others for name, others in versions.items() if others and name in {s.name for s in live}}

    rejected = list(previous.rejected)
    bank = RoundBank(live=live, candidates=candidates, rejected=rejected, versions=versions,
                     changelog=previous.changelog)
    counts = {verb: sum(c.verb == verb for c in changes) for verb in ("added", "promoted", "rejected", "revised",
                                                                       "retired", "pruned")}
    metrics.update({"method": params.mine.method, "mined": len(mined), "live": len(live),
                    "candidates": len(candidates), "rejected_total": len(rejected)
                    + counts["rejected"], **{f"{verb}": n for verb, n in counts.items()}})
    return bank, changes, metrics


def _brief(record: dict[str, Any]) -> dict[str, Any]:
    return {k: record[k] for k in ("u", "welch_t", "n_base", "n_aug", "mean_base", "mean_aug") if k in record}


def run(params: Params, layout: Layout, round_index: int) -> dict[str, Any]:
    frame, _ = read_steps(require(layout.steps(round_index), f"rollout_{round_index}"))
    # round 0's bank is the warm start's (always written, empty when it mined none): a missing one is an error
    previous = load_round_bank(require(layout.skills(round_index - 1),
                                       "warmstart" if round_index == 1 else f"mine_{round_index - 1}"))
    episodes = episode_table(read_trials(layout.skill_trials(round_index)))
    writer = skill_writer(params, layout, round_index)
    bank, changes, metrics = lifecycle_round(previous, episodes, frame, params, round_index, writer)
    header = (f"round {round_index}: mined ({metrics['method']}) {metrics['mined']}; {metrics['live']} live "
              f"skill(s), {metrics['candidates']} candidate(s); "
              + ", ".join(f"{verb} {metrics[verb]}" for verb in ("added", "promoted", "rejected", "revised",
                                                                  "retired", "pruned")))
    successful = int(frame.loc[frame["won"].astype(bool), "trajectory_id"].nunique())
    metrics.update({"round": round_index, "successful_trajectories": successful,
                    "changes": [c.line() for c in changes]})
    outputs = [layout.skills(round_index), layout.round_metrics(round_index, "mine")]
    with staged_outputs(layout.root, f"mine_{round_index}", outputs) as out:
        save_round_bank(out.path(outputs[0]), bank, changes, header=header)
        write_json(out.path(outputs[1]), metrics)
    return metrics
