"""MDL mining of macro skills (docs/algorithms.md section 9): abstraction, description length, greedy selection, skills."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skills.bank import read_skill, validate_skill_name, write_skill
from skills.mdl import (abstract_actions, canonical_macro, description_length, instantiate_macro, match_macro,
                        mine_mdl_skills, select_mdl_dictionary, slot_name)

PLANTED = ("go to {a}", "open {a}", "take {b} from {a}")
TINY = [  # 11 actions; the planted routine occurs once in each trajectory
    ["go to fridge 1", "open fridge 1", "take apple 1 from fridge 1", "go to countertop 1"],
    ["go to cabinet 2", "open cabinet 2", "take mug 3 from cabinet 2"],
    ["go to drawer 1", "open drawer 1", "take pen 1 from drawer 1", "put pen 1 in desk 1"],
]
RECEPTACLES = ["cabinet", "drawer", "fridge", "shelf", "countertop", "sinkbasin", "desk", "microwave"]
OBJECTS = ["apple", "mug", "pen", "book", "tomato", "cloth", "spoon", "key"]


def _noise_action(rng: random.Random) -> str:
    recep, obj = f"{rng.choice(RECEPTACLES)} {rng.randint(1, 4)}", f"{rng.choice(OBJECTS)} {rng.randint(1, 3)}"
    return rng.choice([f"go to {recep}", f"examine {obj}", f"put {obj} in {recep}", "look", "inventory",
                       f"clean {obj} with {recep}", f"use desklamp {rng.randint(1, 2)}"])


def _window_keys(corpus: list[list[str]], max_length: int) -> set[tuple[str, ...]]:
    return {abstract_actions(actions[s:s + n])[0] for actions in corpus for n in range(2, max_length + 1)
            for s in range(len(actions) - n + 1) if all(actions[s:s + n])}


# ------------------------------------------------------------------------------------------------ abstraction

def test_abstract_actions_binds_entities_to_slots_across_the_sequence() -> None:
    symbols, bindings = abstract_actions(["go to fridge 1", "open fridge 1", "take apple 12 from fridge 1",
                                          "put apple 12 in countertop 2", "raise 20", "go north 2", "look"])
    assert symbols == ("go to {a}", "open {a}", "take {b} from {a}", "put {b} in {c}", "raise 20", "go north 2",
                       "look")
    assert bindings == [{"a": "fridge 1"}, {"a": "fridge 1"}, {"b": "apple 12", "a": "fridge 1"},
                        {"b": "apple 12", "c": "countertop 2"}, {}, {}, {}]


def test_literal_braces_are_escaped_and_survive_instantiation() -> None:
    actions = ["echo {x} > file 1", "cat file 1"]
    symbols, bindings = abstract_actions(actions)
    assert symbols == ("echo {{x}} > {a}", "cat {a}")
    assert instantiate_macro(symbols, {"a": "file 1"}) == actions
    assert match_macro(symbols, actions) == {"a": "file 1"}


def test_slot_names_and_canonical_form() -> None:
    assert [slot_name(i) for i in (0, 1, 25, 26, 27, 701, 702)] == ["a", "b", "z", "aa", "ab", "zz", "aaa"]
    assert canonical_macro(["go to {recep}", "take {obj} from {recep}"]) == ("go to {a}", "take {b} from {a}")


def test_instantiate_and_match_errors() -> None:
    with pytest.raises(ValueError, match=r"missing bindings \['b'\]"):
        instantiate_macro(PLANTED, {"a": "fridge 1"})
    with pytest.raises(ValueError, match=r"unknown bindings \['c'\]"):
        instantiate_macro(PLANTED, {"a": "fridge 1", "b": "apple 1", "c": "mug 1"})
    with pytest.raises(ValueError, match="stray brace"):
        instantiate_macro(["go to {A}"], {})
    assert match_macro(PLANTED, TINY[0][:2]) is None  # wrong length
    assert match_macro(PLANTED, ["go to fridge 1", "open fridge 2", "take apple 1 from fridge 1"]) is None
    assert match_macro(("go to {a}", "go to {b}"), ["go to fridge 1", "go to fridge 1"]) is None  # a != b
    assert match_macro(("go to {a}",), ["go to kitchen"]) is None  # slots bind numbered entities only


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 6))
def test_match_is_exactly_abstraction_equality(seed: int, length: int) -> None:
    rng = random.Random(seed)
    window = [_noise_action(rng) for _ in range(length)]
    macro, per_step = abstract_actions(window)
    merged = {slot: entity for bound in per_step for slot, entity in bound.items()}
    assert match_macro(macro, window) == merged
    assert instantiate_macro(macro, merged) == window
    other = [_noise_action(rng) for _ in range(length)]
    assert (match_macro(macro, other) is not None) == (abstract_actions(other)[0] == macro)


# ------------------------------------------------------------------------------------------- description length

def test_description_length_hand_computed() -> None:
    assert description_length(TINY, []) == 11
    # dictionary 3 + 1 = 4; encoding: trajectory 1 -> [M, go to] = 2, 2 -> [M] = 1, 3 -> [M, put] = 2
    assert description_length(TINY, [PLANTED]) == 4 + 5
    # the pair occurs 3 times: saves 3, costs 3
    assert description_length(TINY, [PLANTED[:2]]) == 3 + 8
    # order matters: the pair takes go/open first, so the triple finds nothing left: 3 + 4 + 8
    assert description_length(TINY, [PLANTED[:2], PLANTED]) == 15
    # macros are compared in canonical form
    assert description_length(TINY, [["go to {r}", "open {r}", "take {o} from {r}"]]) == 9


def test_occurrences_do_not_overlap_and_invalid_actions_break_windows() -> None:
    corpus = [["up", "up", "up", "up", "up"]]  # ("up", "up"): occurrences at 0 and 2 only
    assert description_length(corpus, [("up", "up")]) == 3 + 3
    assert description_length([["left", "", "right", "left", "right"]], [("left", "right")]) == 3 + 4


# ------------------------------------------------------------------------------------------------ selection

def test_greedy_selection_on_the_tiny_corpus() -> None:
    skills = mine_mdl_skills([(f"t{i}", actions) for i, actions in enumerate(TINY)])
    assert len(skills) == 1  # the pairs only break even (gain 0), the 4-step windows occur once
    top = skills[0]
    assert top.macro == PLANTED
    assert top.stats == {"mdl_gain": 11 - 9, "count": 3, "length": 3, "support": 1.0}
    assert top.provenance == ("t0", "t1", "t2")
    assert "Example (trajectory t0): {a} = fridge 1, {b} = apple 1." in top.procedure
    assert "1. `go to {a}`\n2. `open {a}`\n3. `take {b} from {a}`" in top.procedure
    assert "go to <a>, then open <a>, then take <b> from <a>" in top.when_to_use


def test_a_pair_pays_off_from_four_occurrences() -> None:
    three = [(f"t{i}", ["look", "inventory"]) for i in range(3)]
    assert mine_mdl_skills(three) == []  # gain 3 * 1 - 3 = 0
    four = three + [("t3", ["look", "inventory"])]
    [skill] = mine_mdl_skills(four)
    assert skill.macro == ("look", "inventory") and skill.stats["mdl_gain"] == 1
    assert mine_mdl_skills(four, min_count=5) == []
    assert mine_mdl_skills(four, max_skills=0) == []


def _planted_corpus(seed: int) -> tuple[list[tuple[str, list[str]]], set[str]]:
    rng = random.Random(seed)
    corpus, planted = [], set()
    for i in range(24):
        actions = [_noise_action(rng) for _ in range(rng.randint(3, 8))]
        if i % 3 != 2:  # 16 of 24 trajectories carry the routine, with their own names
            recep = f"{rng.choice(['cabinet', 'drawer', 'fridge'])} {rng.randint(1, 5)}"
            obj = f"{rng.choice(OBJECTS)} {rng.randint(1, 3)}"
            cut = rng.randint(0, len(actions))
            actions[cut:cut] = [f"go to {recep}", f"open {recep}", f"take {obj} from {recep}"]
            planted.add(f"traj-{i:02d}")
        corpus.append((f"traj-{i:02d}", actions))
    return corpus, planted


def test_planted_subprocedure_is_the_top_skill_with_its_slots() -> None:
    corpus, planted = _planted_corpus(seed=11)
    skills = mine_mdl_skills(corpus)
    top = skills[0]
    assert top.macro == PLANTED
    assert top.stats == {"mdl_gain": 16 * 2 - 4, "count": 16, "length": 3, "support": pytest.approx(16 / 24)}
    assert set(top.provenance) == planted
    sequences = [actions for _, actions in corpus]
    assert top.stats["mdl_gain"] == description_length(sequences, []) - description_length(sequences, [top.macro])
    for tid, actions in corpus:  # the macro recognizes each planted occurrence with the right bindings
        hits = [match_macro(top.macro, actions[s:s + 3]) for s in range(len(actions) - 2)]
        hits = [h for h in hits if h is not None]
        assert len(hits) == (tid in planted)
        if hits:
            assert f"go to {hits[0]['a']}" in actions and f"take {hits[0]['b']} from {hits[0]['a']}" in actions


def test_random_sequences_without_structure_yield_no_skill() -> None:
    rng = random.Random(5)
    vocabulary = [f"{verb} {thing}" for verb in ("push", "pull", "turn", "lift", "wave") for thing in
                  ("lever", "rope", "wheel", "stone", "bell", "door")]  # 30 literal actions, no entities
    corpus = [(f"r{i}", [rng.choice(vocabulary) for _ in range(rng.randint(4, 8))]) for i in range(20)]
    assert mine_mdl_skills(corpus) == []
    sequences = [actions for _, actions in corpus]
    base = description_length(sequences, [])
    assert all(description_length(sequences, [key]) >= base for key in _window_keys(sequences, 5))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_greedy_choice_matches_brute_force_description_lengths(seed: int) -> None:
    rng = random.Random(seed)
    corpus = [(f"s{i}", [rng.choice(["up", "down", "left", f"go to box {rng.randint(1, 2)}", ""])
                         for _ in range(rng.randint(2, 9))]) for i in range(20)]
    sequences = [actions for _, actions in corpus]
    choices = select_mdl_dictionary(corpus, max_length=4, max_skills=3)
    assert len(choices) >= 2
    keys = _window_keys(sequences, 4)
    chosen: list[tuple[str, ...]] = []
    for choice in choices:
        current = description_length(sequences, chosen)
        gains = {key: current - description_length(sequences, chosen + [key]) for key in keys}
        best = max(gains.values())
        assert choice.gain == best > 0
        # ties go to the longer macro, then the smaller key
        assert choice.macro == min((k for k, g in gains.items() if g == best), key=lambda k: (-len(k), k))
        assert current - description_length(sequences, chosen + [choice.macro]) == choice.gain
        chosen.append(choice.macro)
    if len(choices) < 3:  # stopped because nothing else compresses
        final = description_length(sequences, chosen)
        assert all(description_length(sequences, chosen + [key]) >= final for key in keys)


# ------------------------------------------------------------------------------------------------ skills

def test_deterministic_and_independent_of_input_order() -> None:
    corpus, _ = _planted_corpus(seed=3)
    first = mine_mdl_skills(corpus)
    shuffled = list(corpus)
    random.Random(0).shuffle(shuffled)
    assert mine_mdl_skills(shuffled) == first == mine_mdl_skills(corpus)
    assert [s.stats for s in mine_mdl_skills(shuffled)] == [s.stats for s in first]


def test_skills_round_trip_through_the_bank_with_valid_distinct_names(tmp_path) -> None:
    corpus, _ = _planted_corpus(seed=11)
    skills = mine_mdl_skills(corpus)
    assert len({s.name for s in skills}) == len(skills) >= 1
    for skill in skills:
        assert validate_skill_name(skill.name).startswith("macro-")
        assert read_skill(write_skill(tmp_path, skill)) == skill


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="duplicate trajectory ids"):
        mine_mdl_skills([("a", ["up"]), ("a", ["down"])])
    with pytest.raises(ValueError, match="max_length must be >= 2"):
        mine_mdl_skills([], max_length=1)
    with pytest.raises(ValueError, match="min_count"):
        mine_mdl_skills([], min_count=0)
    assert mine_mdl_skills([]) == []
