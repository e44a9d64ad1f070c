"""The stages' skill slot: state-grounded retrieval over the round's bank, asked with the episode's query."""
from agents.rollout import SkillQuery
from envs.base import Scenario
from skills.bank import Skill
from tasks.common import skill_slot
from tasks.config import parse_params

HOLE = Skill(name="avoid-holes", when_to_use="When a hole H is next to you.", procedure="Step around the hole.")
GOAL = Skill(name="finish-goal", when_to_use="When the goal G is one step away.", procedure="Step onto the goal.")
SCENARIO = Scenario(env="frozenlake", seed=1, split="train")


def test_the_observation_picks_the_skill_and_k_zero_or_an_empty_bank_gives_no_slot():
    slot = skill_slot([HOLE, GOAL], parse_params({"skills": {"retrieval": {"k": 1, "alpha": 0.3}}}))
    task = "Reach the goal without stepping on a hole."
    shown = slot(SkillQuery(SCENARIO, task, "a hole H is right next to you", 0))
    assert list(shown.ids) == ["avoid-holes"] and shown.text == "Skill 1: Step around the hole."
    assert list(slot(SkillQuery(SCENARIO, task, "the goal G is one step away", 3)).ids) == ["finish-goal"]
    assert skill_slot([HOLE, GOAL], parse_params({"skills": {"retrieval": {"k": 0}}})) is None
    assert skill_slot([], parse_params({})) is None


def test_the_floor_leaves_the_slot_empty_when_nothing_matches():
    query = SkillQuery(SCENARIO, "Sort the numbers.", "7 3 9", 0)
    assert skill_slot([HOLE, GOAL], parse_params({}))(query).ids != ()  # floor 0: the best skill is always shown
    empty = skill_slot([HOLE, GOAL], parse_params({"skills": {"retrieval": {"floor": 0.1}}}))(query)
    assert (empty.text, tuple(empty.ids), dict(empty.macros)) == ("", (), {})
