"""Unseen held-out sets: candidate draws, the pure selection, and every env's held-out keys disjoint from train's."""
from __future__ import annotations

import pytest

import envs  # noqa: F401  (importing the package registers the envs)
from envs import ENVS
from envs.base import Scenario, scenario_content_keys
from envs.scenarios import (MAX_CANDIDATES_PER_SCENARIO, SPLIT_SEED_RANGE, UnseenScenarioShortage,
                            candidate_scenarios, make_scenarios, select_unseen, unseen_heldout)

ENV_NAMES = sorted(name for name in ENVS if not name.startswith("_test"))
FROZENLAKE = {"size": 4, "p_frozen": 0.8, "max_steps": 12, "is_slippery": False, "invalid_penalty": 0.1}


def fake(keys: str) -> tuple[list[Scenario], dict[Scenario, str]]:
    """One frozenlake scenario per letter of ``keys`` (seeds 0, 1, ...) and the key each one gets."""
    scenarios = [Scenario(env="frozenlake", seed=i, split="heldout") for i in range(len(keys))]
    return scenarios, dict(zip(scenarios, keys))


def test_select_unseen_skips_train_keys_and_repeats_in_draw_order():
    candidates, key = fake("abacd")
    selection = select_unseen(candidates, key.get, {"b"}, 2, max_candidates=10)
    # a kept; b seen in train; a repeats the kept a; c kept: 4 drawn, d never looked at
    assert selection.scenarios == (candidates[0], candidates[3])
    assert (selection.candidates, selection.seen_dropped, selection.duplicates_dropped) == (4, 1, 1)
    assert selection.overlap_before == 1  # of the first n=2 candidates (a, b), b is a train scenario's
    assert selection.overlap == 0


def test_select_unseen_can_keep_repeats():
    candidates, key = fake("abacd")
    selection = select_unseen(candidates, key.get, {"b"}, 2, max_candidates=10, distinct=False)
    assert selection.scenarios == (candidates[0], candidates[2])
    assert (selection.candidates, selection.duplicates_dropped) == (3, 0)


def test_select_unseen_stops_at_the_budget_with_a_clear_error():
    candidates, key = fake("abababcd")
    with pytest.raises(UnseenScenarioShortage, match=r"frozenlake: only 1 distinct unseen held-out scenarios in 6 "
                                                     r"candidates, 2 needed \(3 candidates repeat a train scenario, "
                                                     r"2 an earlier held-out one\)") as caught:
        select_unseen(candidates, key.get, {"b"}, 2, max_candidates=6)
    assert (caught.value.found, caught.value.candidates) == (1, 6)
    assert select_unseen(candidates, key.get, {"b"}, 2, max_candidates=7).candidates == 7  # c is the 7th


def test_candidates_start_with_the_plain_draw_then_stay_distinct_and_in_range():
    first = make_scenarios("frozenlake", "heldout", 10, seed=3)
    stream = candidate_scenarios("frozenlake", "heldout", 10, seed=3)
    drawn = [next(stream) for _ in range(55)]
    assert drawn[:10] == first
    assert len({s.seed for s in drawn}) == 55
    assert all(SPLIT_SEED_RANGE <= s.seed < 2 * SPLIT_SEED_RANGE and s.split == "heldout" for s in drawn)
    again = candidate_scenarios("frozenlake", "heldout", 10, seed=3)
    assert [next(again) for _ in range(55)] == drawn
    other = candidate_scenarios("frozenlake", "heldout", 10, seed=4)
    assert [next(other) for _ in range(55)][10:] != drawn[10:]
    household = candidate_scenarios("household", "heldout", 2, seed=0)
    assert all(dict(next(household).options)["split"] == "heldout" for _ in range(5))  # split-aware envs


@pytest.mark.parametrize("name", ENV_NAMES)
def test_every_env_gets_heldout_keys_disjoint_from_train_keys(name):
    train = make_scenarios(name, "train", 24, seed=0)
    selection = unseen_heldout(name, train, 8, seed=0)
    heldout = list(selection.scenarios)
    train_keys, heldout_keys = set(scenario_content_keys(train)), scenario_content_keys(heldout)
    assert len(heldout) == 8 and all(s.env == name and s.split == "heldout" for s in heldout)
    assert not train_keys & set(heldout_keys)
    assert len(set(heldout_keys)) == 8  # no repeats inside the held-out set
    assert selection.overlap == 0 and selection.candidates >= 8
    assert unseen_heldout(name, train, 8, seed=0) == selection  # deterministic


def test_default_frozenlake_sets_overlap_before_filtering_and_not_after():
    train = make_scenarios("frozenlake", "train", 512, seed=0)
    plain = make_scenarios("frozenlake", "heldout", 200, seed=0)
    train_maps = set(scenario_content_keys(train, **FROZENLAKE))
    assert sum(key in train_maps for key in scenario_content_keys(plain, **FROZENLAKE)) == 115  # 57.5 % seen

    selection = unseen_heldout("frozenlake", train, 200, seed=0, env_kwargs=FROZENLAKE)
    heldout_maps = scenario_content_keys(list(selection.scenarios), **FROZENLAKE)
    assert len(selection.scenarios) == 200 and selection.overlap_before == 115 and selection.overlap == 0
    assert not train_maps & set(heldout_maps) and len(set(heldout_maps)) == 200
    assert 200 + 115 <= selection.candidates <= MAX_CANDIDATES_PER_SCENARIO * 200
    kept_plain = [s for s in plain if s in set(selection.scenarios)]
    assert list(selection.scenarios[:len(kept_plain)]) == kept_plain  # the plain draw's unseen ones come first


def test_a_set_that_needs_no_filtering_is_the_plain_draw():
    train = make_scenarios("household", "train", 20, seed=0)
    assert list(unseen_heldout("household", train, 10, seed=0).scenarios) == make_scenarios(
        "household", "heldout", 10, seed=0)


def test_too_few_distinct_maps_raise_a_shortage_naming_the_env():
    # a 2x2 lake has 3 solvable maps (S and G fixed, the two other cells F/F, F/H, H/F): all in 20 train maps
    train = make_scenarios("frozenlake", "train", 20, seed=0)
    tiny = {"size": 2, "p_frozen": 0.5}
    assert len(set(scenario_content_keys(train, **tiny))) == 3
    with pytest.raises(UnseenScenarioShortage, match=r"^frozenlake: only 0 distinct unseen held-out scenarios in 40 "
                                                     r"candidates, 2 needed .*a bigger frozenlake map"):
        unseen_heldout("frozenlake", train, 2, seed=0, env_kwargs=tiny)


def test_keys_depend_on_the_env_kwargs():
    (scenario,) = make_scenarios("frozenlake", "heldout", 1, seed=0)
    assert scenario_content_keys([scenario], size=4) != scenario_content_keys([scenario], size=5)
    with pytest.raises(ValueError, match="one env"):
        scenario_content_keys([scenario, Scenario(env="rps", seed=0, split="train")])
