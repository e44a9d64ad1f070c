"""The lifecycle's bookkeeping: group plans (halves, versions, skip), the round bank on disk, and the mine stage's
versions / pruning / revision steps on hand-made episode tables."""
from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

from agents.rollout import SkillQuery
from envs.base import Scenario
from skills.bank import Skill, SkillFormatError, load_bank, validate_skill_name
from skills.lifecycle import BankChange, RoundBank, load_round_bank, save_round_bank
from skills.versions import SKIP, from_dict
from tasks.config import parse_params
from tasks.mine import lifecycle_round
from tasks.skill_trials import SkillProgram, candidate_results, paired_utilities, render_slot, version_outcomes

WALK = Skill(name="walk", when_to_use="Reach the goal G on the lake.", procedure="Go down, then right.",
             macro=("down", "right"))
LOOK = Skill(name="look-around", when_to_use="Reach the goal G: look first.", procedure="Look around.")
SCENARIOS = [Scenario(env="frozenlake", seed=s, split="train") for s in range(6)]
TASK = "Reach the goal G on the lake."


def query(scenario: Scenario, episode: int) -> SkillQuery:
    return SkillQuery(scenario, TASK, "P F\nF G", 0, episode)


def test_candidate_groups_split_into_halves_that_differ_by_the_candidate():
    program = SkillProgram(RoundBank(live=[WALK], candidates=[LOOK]), k=1, alpha=0.5, floor=0.0)
    program.plan(SCENARIOS, 8, seed=1)
    for scenario in SCENARIOS:
        plan = program.plans[scenario.scenario_id]
        assert plan.test == "candidate" and sorted(plan.arms) == ["aug"] * 4 + ["base"] * 4
        for episode, arm in enumerate(plan.arms):
            shown = [s.name for s in program.shown(query(scenario, episode))]
            assert shown == (["walk", "look-around"] if arm == "aug" else ["walk"])
    arms = [program.plans[s.scenario_id].arms for s in SCENARIOS]
    assert len(set(arms)) > 1  # which member of a pair is augmented is a coin flip per group


def test_paired_groups_show_nothing_to_the_base_half_and_the_slot_makes_macros_callable():
    program = SkillProgram(RoundBank(live=[WALK, LOOK]), k=2, alpha=0.5, floor=0.0)
    program.plan(SCENARIOS[:1], 4, seed=0)
    plan = program.plans[SCENARIOS[0].scenario_id]
    assert plan.test == "paired"
    for episode, arm in enumerate(plan.arms):
        slot = program.skills_for(query(SCENARIOS[0], episode))
        if arm == "base":
            assert slot.text == "" and not slot.macros
        else:
            assert set(slot.ids) == {"walk", "look-around"} and list(slot.macros.values()) == [("down", "right")]
    assert render_slot([LOOK, WALK], macros=True).text == "Skill 1: Look around.\nSkill 2: down right"
    assert dict(render_slot([LOOK, WALK], macros=True).macros) == {"skill 2": ("down", "right")}
    assert dict(render_slot([WALK], macros=False).macros) == {}
    unplanned = SkillProgram(RoundBank(live=[WALK]), k=1, alpha=0.5, floor=0.0, validate=False, paired=False)
    assert [s.name for s in unplanned.shown(query(SCENARIOS[0], 3))] == ["walk"]


def test_versions_are_drawn_per_episode_with_two_distinct_per_group_and_skip_leaves_the_skill_out():
    v2 = replace(WALK, version=2, procedure="Go right, then down.", macro=("right", "down"))
    bank = RoundBank(live=[WALK], versions={"walk": [v2]})
    program = SkillProgram(bank, k=1, alpha=0.5, floor=0.0, skip_arm=True, paired=False)
    program.plan(SCENARIOS, 6, seed=3)
    seen = set()
    for scenario in SCENARIOS:
        labels = program.plans[scenario.scenario_id].versions["walk"]
        assert len(set(labels)) >= 2
        for episode, label in enumerate(labels):
            shown = program.shown(query(scenario, episode))
            seen.add(label)
            if label == SKIP:
                assert shown == []
            else:
                assert [f"v{s.version}" for s in shown] == [label]
    assert seen == {"v1", "v2", SKIP}


def episodes_frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{"trajectory_id": f"t{i}", "candidate": "", "versions": {}, "skills": [], **row}
                         for i, row in enumerate(rows)])


def test_results_utilities_and_version_outcomes_from_an_episode_table():
    rows = []
    for g in range(3):  # candidate groups: aug wins, base loses
        rows += [{"group_id": f"c{g}", "test": "candidate", "arm": "aug", "candidate": "look-around",
                  "skills": ["look-around"], "episode_return": 1.0, "won": True}] * 2
        rows += [{"group_id": f"c{g}", "test": "candidate", "arm": "base", "candidate": "look-around",
                  "episode_return": 0.0, "won": False}] * 2
    rows += [{"group_id": "p0", "test": "paired", "arm": "aug", "skills": ["walk"], "episode_return": 0.0,
              "won": False, "versions": {"walk": "v1"}},
             {"group_id": "p0", "test": "paired", "arm": "aug", "skills": ["walk"], "episode_return": 0.5,
              "won": True, "versions": {"walk": "v2"}},
             {"group_id": "p0", "test": "paired", "arm": "base", "episode_return": 1.0, "won": True,
              "versions": {"walk": SKIP}}]
    episodes = episodes_frame(rows)
    result = candidate_results(episodes, tau=0.0, t_min=1.0)["look-around"]
    assert result.u == 1.0 and result.promote and (result.n_base, result.n_aug) == (6, 6)
    assert paired_utilities(episodes) == {"walk": (pytest.approx(0.25 - 1.0), 1)}
    assert version_outcomes(episodes) == {"walk": [[("v1", 0.0), ("v2", 1.0), (SKIP, 1.0)]]}


def test_the_round_bank_keeps_candidates_rejected_versions_and_the_whole_changelog(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        validate_skill_name("candidates")
    v2 = replace(WALK, version=2, procedure="Go right, then down.")
    bank = RoundBank(live=[WALK], candidates=[LOOK], versions={"walk": [v2]}, changelog="round 0: start\n")
    save_round_bank(tmp_path / "r1", bank, [BankChange("rejected", replace(LOOK, name="bad"), {"u": -0.5})],
                    header="round 1: one change")
    loaded = load_round_bank(tmp_path / "r1")
    assert [s.name for s in loaded.live] == ["walk"] and load_bank(tmp_path / "r1") == [WALK]
    assert loaded.candidates == [LOOK] and loaded.versions == {"walk": [v2]}
    assert [s.name for s in loaded.rejected] == ["bad"] and loaded.rejected[0].stats["evidence"] == {"u": -0.5}
    assert loaded.changelog == 'round 0: start\nround 1: one change\nrejected bad v1 {"u": -0.5}\n'
    assert loaded.all_versions("walk") == [WALK, v2]
    save_round_bank(tmp_path / "r1", RoundBank(changelog=loaded.changelog), [], header="round 1: rewritten")
    assert load_round_bank(tmp_path / "r1").live == [] and not (tmp_path / "r1" / "walk").exists()
    (tmp_path / "r1" / "walk").mkdir()
    (tmp_path / "r1" / "walk" / "SKILL.md").write_text("---\nname: walk\n")
    with pytest.raises(SkillFormatError, match="never closed"):
        load_round_bank(tmp_path / "r1")


def empty_frame() -> pd.DataFrame:
    return pd.DataFrame(columns=["trajectory_id", "step_index", "won", "action", "prompt_text", "observation",
                                 "reward"])


def test_mine_updates_versions_retires_the_loser_and_prunes_useless_and_idle_skills():
    params = parse_params({"skills": {"versions": {"min_uses": 4}, "prune": {"min_utility": -0.05, "max_idle_rounds": 1}}})
    v2 = replace(WALK, version=2, procedure="Go right, then down.")
    idle = replace(LOOK, name="idle", stats={"last_used_round": 1})
    useless = replace(LOOK, name="useless", stats={"utility": 0.0, "last_used_round": 4})
    previous = RoundBank(live=[WALK, idle, useless], versions={"walk": [v2]})
    rows = []
    for g in range(6):  # v2 always wins, v1 always loses, in paired skill halves; 'useless' hurts its groups
        rows += [{"group_id": f"g{g}", "test": "paired", "arm": "aug", "skills": ["walk"], "episode_return": 1.0,
                  "won": True, "versions": {"walk": "v2"}},
                 {"group_id": f"g{g}", "test": "paired", "arm": "aug", "skills": ["walk"], "episode_return": 0.0,
                  "won": False, "versions": {"walk": "v1"}},
                 {"group_id": f"g{g}", "test": "paired", "arm": "base", "episode_return": 0.5, "won": False}]
        rows += [{"group_id": f"h{g}", "test": "paired", "arm": "aug", "skills": ["useless"], "episode_return": 0.0,
                  "won": False},
                 {"group_id": f"h{g}", "test": "paired", "arm": "base", "episode_return": 1.0, "won": True}]
    bank, changes, metrics = lifecycle_round(previous, episodes_frame(rows), empty_frame(), params, round_index=5)
    lines = [c.line() for c in changes]
    assert any(line.startswith("retired walk v1 ") for line in lines), lines
    [walk] = [s for s in bank.live if s.name == "walk"]
    assert walk.version == 2 and walk.procedure == "Go right, then down."   # the better version heads the skill
    state = from_dict(walk.stats["versions"])
    assert state["v1"].retired and not state["v2"].retired and state["v2"].uses == 6
    assert bank.versions == {}                                               # v1 retired: no other active version
    pruned = {c.skill.name: c.evidence["reason"] for c in changes if c.verb == "pruned"}
    assert set(pruned) == {"useless", "idle"} and "utility" in pruned["useless"] and "unused" in pruned["idle"]
    assert [s.name for s in bank.live] == ["walk"] and metrics["pruned"] == 2


class CannedWriter:
    """Answers every prompt with one fixed skill text (a stand-in for a teacher model)."""

    def __init__(self, answer: str):
        self.answer, self.prompts = answer, []

    def complete(self, prompt: str) -> str:
        self.prompts.append(prompt)
        return self.answer


def test_a_failing_live_skill_gets_a_revised_version_from_the_llm_miner():
    params = parse_params({})
    rows = [{"group_id": "g0", "test": "paired", "arm": "aug", "skills": ["walk"], "episode_return": 0.0,
             "won": False},
            {"group_id": "g0", "test": "paired", "arm": "base", "episode_return": 0.0, "won": False}]
    frame = pd.DataFrame([{"trajectory_id": "t0", "step_index": 0, "won": False, "action": "down",
                           "prompt_text": "Task: reach G\nState:\nP F\nAction:", "observation": "P F", "reward": 0.0}])
    writer = CannedWriter("NAME: walk\nWHEN_TO_USE: Reach the goal G.\nPROCEDURE:\n1. Go right first.\n2. Then down.")
    bank, changes, _ = lifecycle_round(RoundBank(live=[WALK]), episodes_frame(rows), frame, params, 2, writer)
    [revised] = [c for c in changes if c.verb == "revised"]
    assert revised.skill.version == 2 and revised.skill.parent == "walk" and "right first" in revised.skill.procedure
    assert bank.versions["walk"][0].version == 2 and "reach G" in writer.prompts[0]
    assert set(from_dict(bank.live[0].stats["versions"])) == {"v1", "v2"}
    assert json.dumps(bank.live[0].stats["versions"])  # YAML/JSON-safe state


def test_the_stage_embedder_param_selects_minilm_and_the_retrieval_is_state_grounded():
    from tasks.common import skill_program

    hole = Skill(name="avoid-holes", when_to_use="When a hole is next to you.", procedure="Step around the hole.")
    goal = Skill(name="finish", when_to_use="When the goal is one step away.", procedure="Step onto the goal.")
    program = skill_program(RoundBank(live=[hole, goal]), parse_params({"skills": {"embedder": "minilm"}}),
                            tests=False)
    assert program.retriever.embedder.name == "all-MiniLM-L6-v2"
    near_hole = SkillQuery(SCENARIOS[0], "Reach the goal.", "There is a pit right beside you.", 0)
    assert [s.name for s in program.shown(near_hole)] == ["avoid-holes"]  # "pit" ~ "hole": no shared word
    with pytest.raises(ValueError, match="skills.embedder"):
        parse_params({"skills": {"embedder": "word2vec"}})


def test_a_corrupt_or_foreign_trials_table_is_refused_with_what_to_do(tmp_path):
    from tasks.skill_trials import read_trials, trial_frame, write_trials

    assert read_trials(tmp_path / "missing.parquet").empty  # rounds written before the lifecycle: no tests
    bad = tmp_path / "skill_trials.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match="rerun the rollout stage"):
        read_trials(bad)
    pd.DataFrame({"trajectory_id": ["t"]}).to_parquet(bad)
    with pytest.raises(ValueError, match="lacks columns"):
        read_trials(bad)
    write_trials(trial_frame([], None), bad)
    assert read_trials(bad).empty


def test_the_trials_table_reads_the_skill_trace_from_the_steps(tmp_path):
    """trial_frame needs no side channel: the plain prompts and macro sub-steps are StepRecord fields; the
    trajectory's metadata is left as it was (nothing popped), and the table round-trips through Parquet."""
    from datapool.records import StepRecord, TrajectoryRecord
    from tasks.skill_trials import read_trials, trial_frame, write_trials

    program = SkillProgram(RoundBank(live=[WALK], candidates=[LOOK]), k=1, alpha=0.5, floor=0.0)
    program.plan(SCENARIOS[:1], 2, seed=1)
    plan = program.plans[SCENARIOS[0].scenario_id]
    aug = plan.arms.index("aug")

    def step(k: int, **trace) -> StepRecord:
        return StepRecord(trajectory_id="t", group_id="g", step_index=k, prompt_ids=[1, 2], response_ids=[3],
                          logprobs=[-0.5], prompt_text="p", observation="o", action="a", response_text=" a",
                          reward=0.0, anchor="", policy_version="v", skill_ids=["walk", "look-around"], **trace)

    metadata = {"scenario_id": SCENARIOS[0].scenario_id, "episode_index": aug}
    traj = TrajectoryRecord(trajectory_id="t", group_id="g", scenario="{}", env="frozenlake", split="train",
                            round=1, policy_version="v", status="complete", episode_return=1.0, won=True,
                            num_steps=2, response_tokens=2, metadata=dict(metadata), steps=[
                                step(0, plain_prompt_ids=[2]),
                                step(1, plain_prompt_ids=[5], macro_prompt_ids=[[5], [5, 6]],
                                     macro_action_ids=[[7, 0], [8, 0]])])
    trials = trial_frame([traj], program)
    assert traj.metadata == metadata
    assert trials["arm"].tolist() == ["aug", "aug"] and trials["candidate"].tolist() == ["look-around"] * 2
    assert "plain_prompt_ids" not in trials.columns  # SIRI reads the trace from the steps themselves, one copy
    back = read_trials(write_trials(trials, tmp_path / "trials.parquet"))
    assert back["arm"].tolist() == ["aug", "aug"] and back["skill_ids"].map(list).tolist() == [["walk", "look-around"]] * 2
