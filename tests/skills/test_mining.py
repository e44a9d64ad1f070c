"""Frequent contiguous sub-sequence mining over successful trajectories."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skills.bank import validate_skill_name
from skills.mining import describe_sequence, mine_frequent_subsequences, skill_name_for


def _occurs(actions: list[str], sequence: tuple[str, ...]) -> bool:
    n = len(sequence)
    return any(tuple(actions[i:i + n]) == sequence for i in range(len(actions) - n + 1))


def test_planted_subsequence_is_found_in_noisy_sequences() -> None:
    rng = random.Random(7)
    planted = ["right", "right", "down"]
    sequences = []
    for i in range(40):
        noise = [rng.choice(["left", "up", "down", "right"]) for _ in range(rng.randint(3, 8))]
        if i % 4 != 3:  # 75% of trajectories carry the routine somewhere
            cut = rng.randint(0, len(noise))
            noise[cut:cut] = planted
        sequences.append((f"traj-{i:02d}", noise))
    skills = mine_frequent_subsequences(sequences, min_support=0.5, top_k=3)
    top = skills[0]
    assert top.macro == ("right", "right", "down") and top.name == "seq-right-right-down"
    assert top.procedure == "Move right, then right, then down."
    supporting = sorted(tid for tid, actions in sequences if _occurs(actions, top.macro))
    assert top.stats == {"support": pytest.approx(len(supporting) / 40), "count": len(supporting), "length": 3}
    assert top.provenance == tuple(supporting[:20]) and len(top.provenance) == 20
    assert "right right down" in top.when_to_use


def test_support_counts_each_trajectory_once_and_hand_worked_ranking() -> None:
    sequences = [
        ("a", ["up", "up", "up", "up"]),   # "up up" occurs 3 times here, counted once
        ("b", ["up", "up", "left"]),
        ("c", ["left", "down"]),
        ("d", ["down", "right"]),
    ]
    skills = mine_frequent_subsequences(sequences, min_length=2, max_length=3, min_support=0.25, top_k=10)
    by_macro = {s.macro: s for s in skills}
    assert by_macro[("up", "up")].stats == {"support": 0.5, "count": 2, "length": 2}
    # ("up","up","up") is in a only: support 0.25 x 3 = 0.75; ("up","up") 0.5 x 2 = 1.0 ranks first
    assert skills[0].macro == ("up", "up")
    # ("up","left") has support 0.25 and is inside ("up","up","left") with equal support: removed
    assert ("up", "left") not in by_macro and ("up", "up", "left") in by_macro
    # ties on support x length then support then length: broken by the sequence, alphabetically
    assert [s.macro for s in skills] == [
        ("up", "up"), ("up", "up", "left"), ("up", "up", "up"), ("down", "right"), ("left", "down")]


def test_min_support_and_top_k() -> None:
    sequences = [(f"t{i}", ["a", "b", "c"] if i < 3 else ["x", "y"]) for i in range(10)]
    skills = mine_frequent_subsequences(sequences, min_support=0.3)
    # 0.7 x 2 = 1.4 beats 0.3 x 3 = 0.9; "a b" and "b c" are inside "a b c" with equal support
    assert [s.macro for s in skills] == [("x", "y"), ("a", "b", "c")]
    assert [s.macro for s in mine_frequent_subsequences(sequences, min_support=0.31)] == [("x", "y")]
    assert mine_frequent_subsequences(sequences, min_support=0.71) == []
    assert [s.macro for s in mine_frequent_subsequences(sequences, min_support=0.1, top_k=1)] == [("x", "y")]


def test_result_does_not_depend_on_input_order() -> None:
    rng = random.Random(3)
    sequences = [(f"t{i}", [rng.choice("abc") for _ in range(6)]) for i in range(30)]
    first = mine_frequent_subsequences(sequences, min_support=0.2, top_k=8)
    rng.shuffle(sequences)
    assert mine_frequent_subsequences(sequences, min_support=0.2, top_k=8) == first


def test_empty_actions_break_sequences_and_edge_cases() -> None:
    skills = mine_frequent_subsequences([("a", ["up", "", "up"]), ("b", ["up", "", "up"])], min_support=0.5)
    assert skills == []
    assert mine_frequent_subsequences([]) == []
    with pytest.raises(ValueError, match="duplicate"):
        mine_frequent_subsequences([("a", ["x", "y"]), ("a", ["x", "y"])])
    with pytest.raises(ValueError, match="min_length"):
        mine_frequent_subsequences([("a", ["x"])], min_length=3, max_length=2)
    with pytest.raises(ValueError, match="min_support"):
        mine_frequent_subsequences([("a", ["x"])], min_support=0.0)


def test_names_stay_valid_for_any_action_text() -> None:
    assert skill_name_for(("go north", "take key")).startswith("seq-go-north-take-key-")
    long = skill_name_for(tuple(["open-the-heavy-wooden-door"] * 4))
    assert len(long) <= 64
    for name in (long, skill_name_for(("É", "!!"))):
        validate_skill_name(name)
    assert describe_sequence(("take key", "go north")) == "Do `take key`, then `go north`."
    skills = mine_frequent_subsequences([("a", ["a-b", "c", "a", "b-c"]), ("b", ["a-b", "c", "a", "b-c"])],
                                        min_length=2, max_length=2, min_support=1.0, top_k=5)
    assert len({s.name for s in skills}) == len(skills)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["up", "down", "left", "right"]), max_size=8), min_size=1, max_size=12),
       st.floats(0.05, 1.0), st.integers(1, 3), st.integers(0, 2))
def test_every_mined_skill_is_as_frequent_as_claimed(actions, min_support, min_length, extra) -> None:
    sequences = [(f"t{i}", a) for i, a in enumerate(actions)]
    skills = mine_frequent_subsequences(sequences, min_length=min_length, max_length=min_length + extra,
                                        min_support=min_support, top_k=10)
    scores = []
    for skill in skills:
        holders = [tid for tid, a in sequences if _occurs(a, skill.macro)]
        assert skill.stats["count"] == len(holders) and len(holders) / len(sequences) >= min_support - 1e-9
        assert min_length <= len(skill.macro) <= min_length + extra
        assert skill.provenance == tuple(sorted(holders)[:20])
        scores.append(skill.stats["count"] * len(skill.macro))
    assert scores == sorted(scores, reverse=True)
