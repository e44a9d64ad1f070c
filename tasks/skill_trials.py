"""The skill lifecycle's rollout side: what each episode of a group is shown, and what the halves measured.

A rollout group (G episodes of one scenario) is one of three kinds of test (docs/algorithms.md section 9):

- ``candidate``: the bank has candidates waiting for validation. The group is split by skills.validation.split_group
  into a base half (the skills retrieval picks from the live bank, R) and an augmented half (R + the candidate); the
  halves share the scenario, so the difference between them is the candidate. Candidates take turns over groups.
- ``paired`` (skills.paired): no candidate, but live skills: a skill-free half and a skill-guided half (R). This
  measures the live skills' utility (pruning), gives the skillc/d2skill estimators their ``skill_used`` flag, and
  the skill-guided steps are internalization's data.
- ``""``: no skills at all.

Every half still trains the policy: no extra rollouts. Skills with several active versions get a version per episode
by Thompson sampling within the group (skills.versions); a "skip" label leaves the skill out of that prompt.

``SkillProgram`` answers the rollout loop's skill slot (agents.rollout.SkillSlot: text, ids, callable macros), and
``trial_frame`` writes down, per step, the test, the arm, the skills and versions shown (``layout.skill_trials``;
SIRI's plain prompts are the steps' own ``plain_prompt_ids``/``macro_*_ids`` fields).
``episode_table``, ``candidate_results``, ``paired_utilities``, ``group_gaps`` and ``version_outcomes`` read
that table back: the mine stage (promote/reject/prune/version) and the train stage (skill_used, internalization)
compute the same numbers from the same function.
"""
from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from agents.rollout import SkillQuery, SkillSlot
from datapool.records import TrajectoryRecord
from envs.base import Scenario
from skills.bank import Skill
from skills.embeddings import CachedEmbedder, TfidfEmbedder, default_embedder
from skills.lifecycle import RoundBank
from skills.retrieval import SkillRetriever, skill_line, skill_text
from skills.validation import ValidationResult, split_group, utility
from skills.versions import SKIP, VersionConfig, add_version, assign_group, from_dict, new_state

TESTS = ("", "candidate", "paired")
ARMS = ("", "base", "aug")
MACRO_KEYWORD = "skill {index}"


def version_label(skill: Skill) -> str:
    return f"v{skill.version}"


def version_state(skill: Skill, others: Sequence[Skill], *, skip: bool = False) -> dict:
    """Thompson state of a skill's versions: its stored ``stats["versions"]``, with every active version (and the
    skip arm, when asked) present, new ones at the prior."""
    state = from_dict(skill.stats.get("versions") or {})
    for version in [skill, *others]:
        if version_label(version) not in state:
            state = add_version(state, version_label(version))
    if skip and SKIP not in state:
        state = {**state, **new_state([], skip=True)}
    return state


def make_embedder(kind: str, texts: Sequence[str]) -> CachedEmbedder:
    """Retrieval embeddings for a bank: TF-IDF fitted on its texts, or MiniLM (TF-IDF fallback when absent)."""
    if kind == "minilm":
        return default_embedder(texts)
    if kind != "tfidf":
        raise ValueError(f"unknown skill embedder {kind!r}; valid: tfidf, minilm")
    return CachedEmbedder(TfidfEmbedder(list(texts)))


def render_slot(skills: Sequence[Skill], *, macros: bool) -> SkillSlot:
    """The prompt's skill slot: ``Skill 1: <macro actions or first procedure line>`` per skill; with ``macros`` each
    macro skill is callable as ``skill <i>`` (followed by its slot arguments, if any)."""
    text = "\n".join(f"Skill {index}: {skill_line(skill)}" for index, skill in enumerate(skills, start=1))
    calls = {MACRO_KEYWORD.format(index=index): tuple(skill.macro)
             for index, skill in enumerate(skills, start=1) if macros and skill.macro}
    return SkillSlot(text, tuple(s.name for s in skills), calls)


@dataclass(frozen=True)
class GroupPlan:
    test: str
    candidate: Skill | None
    arms: tuple[str, ...]
    """Per episode: "base", "aug" or "" (no test)."""
    versions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Skill name -> version label per episode, for skills with several versions (or a skip arm)."""


class SkillProgram:
    """Plans each group's skill test and fills the skill slot of every episode (``skills_for``)."""

    def __init__(self, bank: RoundBank, *, k: int, alpha: float, floor: float, embedder: str = "tfidf",
                 ucb_c: float = 0.0, macros: bool = True, validate: bool = True, paired: bool = True, skip_arm: bool = False,
                 version_config: VersionConfig = VersionConfig()) -> None:
        self.bank, self.k, self.macros = bank, k, macros
        self.validate, self.paired, self.skip_arm = validate, paired, skip_arm
        self.version_config = version_config
        self.retriever = (SkillRetriever(bank.live, make_embedder(embedder, [skill_text(s) for s in bank.live]),
                                         alpha=alpha, k=k, floor=floor, ucb_c=ucb_c)
                          if bank.live and k > 0 else None)
        self.version_states = {}
        for skill in bank.live:
            others = bank.versions.get(skill.name, [])
            if others or skip_arm:
                self.version_states[skill.name] = version_state(skill, others, skip=skip_arm)
        self.by_version = {(s.name, version_label(s)): s for s in bank.live}
        self.by_version.update({(o.name, version_label(o)): o for others in bank.versions.values() for o in others})
        self.plans: dict[str, GroupPlan] = {}

    @property
    def active(self) -> bool:
        return bool(self.bank.live or (self.validate and self.bank.candidates))

    def plan(self, scenarios: Sequence[Scenario], group_size: int, seed: int) -> None:
        """Decide every scenario's test, halves and versions (deterministic in ``seed``)."""
        candidates = list(self.bank.candidates) if self.validate else []
        for position, scenario in enumerate(scenarios):
            rng = random.Random(zlib.crc32(f"{seed}|{scenario.scenario_id}".encode()))
            base, aug = split_group(range(group_size), rng.randrange(2**31))
            if candidates:
                test, candidate = "candidate", candidates[position % len(candidates)]
            elif self.paired and self.retriever is not None:
                test, candidate = "paired", None
            else:
                test, candidate = "", None
            arms = ["" if not test else ("aug" if i in aug else "base") for i in range(group_size)]
            versions = {name: tuple(assign_group(state, group_size, rng, self.version_config))
                        for name, state in sorted(self.version_states.items())}
            self.plans[scenario.scenario_id] = GroupPlan(test, candidate, tuple(arms), versions)

    def shown(self, query: SkillQuery) -> list[Skill]:
        """The skills one episode's prompt shows at this query."""
        plan = self.plans.get(query.scenario.scenario_id)
        arm = plan.arms[query.episode] if plan is not None and query.episode < len(plan.arms) else ""
        retrieved: list[Skill] = []
        if self.retriever is not None and not (plan is not None and plan.test == "paired" and arm == "base"):
            retrieved = [skill for skill, _ in self.retriever.retrieve(query.task, query.observation)]
        if plan is not None:
            chosen = []
            for skill in retrieved:
                labels = plan.versions.get(skill.name)
                if labels is None:
                    chosen.append(skill)
                elif labels[query.episode] != SKIP:
                    chosen.append(self.by_version[(skill.name, labels[query.episode])])
            retrieved = chosen
            if plan.test == "candidate" and arm == "aug" and plan.candidate is not None:
                retrieved = [s for s in retrieved if s.name != plan.candidate.name] + [plan.candidate]
        return retrieved

    def skills_for(self, query: SkillQuery) -> SkillSlot:
        return render_slot(self.shown(query), macros=self.macros)

    def version_shown(self, scenario_id: str, episode: int) -> dict[str, str]:
        plan = self.plans.get(scenario_id)
        return {} if plan is None else {name: labels[episode] for name, labels in plan.versions.items()}


# ------------------------------------------------------------------------------------------- the trials table

TRIAL_SCHEMA = pa.schema([
    pa.field("trajectory_id", pa.string()), pa.field("group_id", pa.string()), pa.field("step_index", pa.int64()),
    pa.field("scenario_id", pa.string()), pa.field("episode", pa.int64()), pa.field("test", pa.string()),
    pa.field("arm", pa.string()), pa.field("candidate", pa.string()), pa.field("skill_ids", pa.list_(pa.string())),
    pa.field("versions", pa.string()), pa.field("episode_return", pa.float64()), pa.field("won", pa.bool_()),
])


def trial_frame(trajectories: Sequence[TrajectoryRecord], program: SkillProgram | None) -> pd.DataFrame:
    """One row per step: the group's test, the episode's arm, the candidate, the skills (and versions) its prompts
    showed. What SIRI distills onto (the prompt without the skill, a macro's sub-steps) is in the steps themselves
    (StepRecord.plain_prompt_ids / macro_prompt_ids / macro_action_ids)."""
    rows = []
    for traj in trajectories:
        scenario_id = str(traj.metadata.get("scenario_id", ""))
        episode = int(traj.metadata.get("episode_index", 0))
        plan = program.plans.get(scenario_id) if program is not None else None
        arm = plan.arms[episode] if plan is not None else ""
        versions = json.dumps(program.version_shown(scenario_id, episode) if program is not None else {},
                              sort_keys=True)
        for step in traj.steps:
            rows.append({
                "trajectory_id": traj.trajectory_id, "group_id": traj.group_id, "step_index": step.step_index,
                "scenario_id": scenario_id, "episode": episode, "test": plan.test if plan is not None else "",
                "arm": arm, "candidate": plan.candidate.name if plan is not None and plan.candidate else "",
                "skill_ids": list(step.skill_ids), "versions": versions,
                "episode_return": float(traj.episode_return), "won": bool(traj.won),
            })
    return pd.DataFrame(rows, columns=TRIAL_SCHEMA.names)


def write_trials(frame: pd.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_pandas(frame, schema=TRIAL_SCHEMA, preserve_index=False), tmp)
    tmp.replace(path)
    return path


def read_trials(path: Path) -> pd.DataFrame:
    """The trials table (an empty one when the rollout wrote none, e.g. older rounds)."""
    if not path.exists():
        return pd.DataFrame(columns=TRIAL_SCHEMA.names)
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"{path}: not a readable skill trials table ({err}); rerun the rollout stage that wrote it "
                         f"(dvc repro rollout_<round>)") from err
    missing = sorted(set(TRIAL_SCHEMA.names) - set(table.column_names))
    if missing:
        raise ValueError(f"{path}: skill trials table lacks columns {missing}; rerun the rollout stage that wrote it")
    return table.to_pandas()


def episode_table(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per episode: test, arm, candidate, every skill shown on any step, versions, return, won."""
    if trials.empty:
        return pd.DataFrame(columns=["trajectory_id", "group_id", "test", "arm", "candidate", "skills", "versions",
                                     "episode_return", "won"])
    rows = []
    for tid, steps in trials.groupby("trajectory_id", sort=True):
        first = steps.iloc[0]
        shown = sorted({name for ids in steps["skill_ids"] for name in ids})
        rows.append({"trajectory_id": tid, "group_id": first["group_id"], "test": first["test"], "arm": first["arm"],
                     "candidate": first["candidate"], "skills": shown, "versions": json.loads(first["versions"]),
                     "episode_return": float(first["episode_return"]), "won": bool(first["won"])})
    return pd.DataFrame(rows)


def candidate_results(episodes: pd.DataFrame, *, tau: float, t_min: float) -> dict[str, ValidationResult]:
    """u(c) and Welch t per candidate, over every group that tested it (base vs augmented returns)."""
    results = {}
    tested = episodes[episodes["test"] == "candidate"] if not episodes.empty else episodes
    for name, rows in tested.groupby("candidate", sort=True):
        base = rows.loc[rows["arm"] == "base", "episode_return"].tolist()
        aug = rows.loc[rows["arm"] == "aug", "episode_return"].tolist()
        results[str(name)] = utility(base, aug, tau=tau, t_min=t_min)
    return results


def group_gaps(episodes: pd.DataFrame) -> dict[str, float]:
    """Per tested group: mean return of the augmented (skill-guided) half - mean return of the base half."""
    gaps = {}
    if episodes.empty:
        return gaps
    for group_id, rows in episodes[episodes["test"] != ""].groupby("group_id", sort=True):
        base = rows.loc[rows["arm"] == "base", "episode_return"]
        aug = rows.loc[rows["arm"] == "aug", "episode_return"]
        if len(base) and len(aug):
            gaps[str(group_id)] = float(aug.mean() - base.mean())
    return gaps


def paired_utilities(episodes: pd.DataFrame) -> dict[str, tuple[float, int]]:
    """Live skill -> (mean gap of the paired groups whose skill-guided half showed it, number of such groups)."""
    gaps = group_gaps(episodes)
    per_skill: dict[str, list[float]] = {}
    if episodes.empty:
        return {}
    paired = episodes[(episodes["test"] == "paired") & (episodes["arm"] == "aug")]
    for group_id, rows in paired.groupby("group_id", sort=True):
        if group_id not in gaps:
            continue
        for name in sorted({n for names in rows["skills"] for n in names}):
            per_skill.setdefault(name, []).append(gaps[group_id])
    return {name: (sum(values) / len(values), len(values)) for name, values in per_skill.items()}


def version_outcomes(episodes: pd.DataFrame) -> dict[str, list[list[tuple[str, float]]]]:
    """Skill -> per group, [(version label, won)] of the episodes that drew a version of it and either saw it or
    drew "skip" (an episode whose retrieval did not pick the skill tells nothing about its versions)."""
    out: dict[str, list[list[tuple[str, float]]]] = {}
    if episodes.empty:
        return out
    for _, rows in episodes.groupby("group_id", sort=True):
        per_skill: dict[str, list[tuple[str, float]]] = {}
        for row in rows.itertuples(index=False):
            for name, label in row.versions.items():
                if label == SKIP or name in row.skills:
                    per_skill.setdefault(name, []).append((label, 1.0 if row.won else 0.0))
        for name, outcomes in per_skill.items():
            out.setdefault(name, []).append(outcomes)
    return out


def skill_used(frame: pd.DataFrame, trials: pd.DataFrame) -> list[bool]:
    """Per row of a step table: whether its episode was in the skill half (augmented) of a tested group."""
    if trials.empty:
        return [False] * len(frame)
    arms = dict(zip(trials["trajectory_id"], trials["arm"]))
    return [arms.get(tid, "") == "aug" for tid in frame["trajectory_id"]]


def with_stats(skill: Skill, **stats: Any) -> Skill:
    return replace(skill, stats={**skill.stats, **stats})
