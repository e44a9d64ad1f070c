"""TF-IDF skill retrieval and the prompt's skill-slot text, on hand-made cases."""
from __future__ import annotations

import math

import pytest

from skills.bank import Skill
from skills.retrieval import render_skills, score_skills, select_skills, tokenize

KEY = Skill(name="find-key", when_to_use="When a locked door blocks the way.", procedure="Search rooms for the key.",
            stats={"support": 0.2})
LAKE = Skill(name="cross-lake", when_to_use="When holes surround the goal.", procedure="Move right, then down.",
             stats={"support": 0.6}, macro=("right", "down"))
COOK = Skill(name="cook-meal", when_to_use="When the recipe needs a fried ingredient.",
             procedure="Take the pan, then fry.", stats={"support": 0.4})
BANK = [KEY, LAKE, COOK]


def test_tokenize_lowercases_and_splits_on_non_alphanumerics() -> None:
    assert tokenize("Move RIGHT, then down-left! 2x") == ["move", "right", "then", "down", "left", "2x"]


def test_query_picks_the_skill_it_shares_words_with() -> None:
    assert select_skills(BANK, "a locked door is in front of you") == [KEY]
    assert select_skills(BANK, "the recipe asks for fried carrot", k=1) == [COOK]
    assert select_skills(BANK, "holes around the goal", k=2)[0] == LAKE


def test_hand_computed_cosine() -> None:
    a = Skill(name="a", when_to_use="x y", procedure="")
    b = Skill(name="b", when_to_use="y", procedure="")
    # idf: x appears in 1 of 2 docs -> log(3/2)+1; y in both -> log(3/3)+1 = 1
    idf_x = math.log(1.5) + 1
    scores = score_skills([a, b], "x")
    assert scores[0] == pytest.approx(idf_x / math.sqrt(idf_x**2 + 1))
    assert scores[1] == 0.0
    assert score_skills([a, b], "y")[1] == pytest.approx(1.0)


def test_ties_break_by_support_then_name() -> None:
    # a query sharing no word with any skill: every score is 0, so support decides
    assert select_skills(BANK, "zzz", k=3) == [LAKE, COOK, KEY]
    twin = Skill(name="another-lake", when_to_use=LAKE.when_to_use, procedure=LAKE.procedure,
                 stats={"support": 0.6})
    assert select_skills([LAKE, twin], "holes", k=2) == [twin, LAKE]  # same score, same support: by name
    no_stats = Skill(name="aaa", when_to_use="holes", procedure="")
    assert select_skills([no_stats, Skill(name="bbb", when_to_use="holes", procedure="", stats={"support": 0.1})],
                         "holes", k=1)[0].name == "bbb"


def test_min_score_and_k() -> None:
    assert select_skills(BANK, "zzz", min_score=0.01) == []
    assert select_skills(BANK, "locked door", k=5, min_score=0.1) == [KEY]
    assert select_skills(BANK, "door", k=0) == [] and select_skills([], "door") == []
    with pytest.raises(ValueError):
        select_skills(BANK, "door", k=-1)


def test_render_is_one_short_line_per_skill() -> None:
    assert render_skills([LAKE]) == "Skill: right down"
    assert render_skills([LAKE, KEY]) == "Skill: right down\nSkill: Search rooms for the key."
    heading = Skill(name="h", when_to_use="w", procedure="# Open the door\n\n1. push")
    assert render_skills([heading]) == "Skill: Open the door"
    assert render_skills([]) == ""
