"""Non-learning baselines (envs/baselines.py): the rules, their tuning on train only, and the memorizer."""
from __future__ import annotations

import random

from envs.baselines import HEURISTICS, baseline_report, down_right_move, read_tree_observation
from envs.scenarios import make_scenarios, unseen_heldout

TREE = {"tree_search": {"branching": 2, "depth": 3, "hint_accuracy": 0.7, "max_steps": 25}}


def test_down_right_rule_steps_around_holes():
    assert down_right_move("P F F\nH F F\nF F G") == "right"     # down is a hole
    assert down_right_move("F P F\nF F F\nF F G") == "down"
    assert down_right_move("F F F\nF F P\nF F G") == "down"


def test_tree_rule_reads_the_hint_and_backs_out_of_dead_ends():
    depth, leaf, high = read_tree_observation("node 2-1, depth 2 of 3\nsignal: 1 low, 2 high")
    assert (depth, leaf, high) == (2, False, 2)
    rule = HEURISTICS["tree_search"]["hint_or_back"].make(random.Random(0))
    assert rule("", "node 2-1, depth 2 of 3\nsignal: 1 low, 2 high", ["child 1", "child 2", "back"], 0) == "child 2"
    assert rule("", "node 2-1-1, depth 3 of 3\ndead end", ["back"], 1) == "back"


def test_report_on_disjoint_heldout_has_the_heuristics_and_a_lookup_that_equals_the_best_rule():
    train = make_scenarios("tree_search", "train", 60, seed=0)
    heldout = list(unseen_heldout("tree_search", train, 40, seed=0, env_kwargs=TREE["tree_search"]).scenarios)
    report = baseline_report(heldout, train, TREE, seeds=(0, 1), tune_scenarios=30)
    assert report["heldout_equal_to_a_train_scenario"] == 0
    assert len(report["random"]["per_seed"]) == 2 and 0 < report["random"]["mean"] < 1
    assert set(report["heuristics"]) == {"hint_or_back", "hint_stochastic"}
    assert report["heuristics"]["hint_stochastic"]["params"] in HEURISTICS["tree_search"]["hint_stochastic"].grid
    best = report["best_heuristic"]["name"]
    assert report["train_lookup"]["mean"] == report["heuristics"][best]["mean"]


def test_the_memorizer_replays_the_expert_on_scenarios_it_saw():
    train = make_scenarios("frozenlake", "train", 30, seed=0)
    report = baseline_report(train[:20], train, {}, seeds=(0,))
    assert report["heldout_equal_to_a_train_scenario"] == 20
    assert report["train_lookup"]["mean"] == 1.0                       # the expert solves every generated map
    assert report["heuristics"]["down_right_rule"]["mean"] < 1.0 or report["random"]["mean"] < 1.0


def test_baselines_play_under_the_policies_decision_budget():
    """4x4 maps need 6 moves (all down and right): with 5 decisions and no macros no baseline can win."""
    train = make_scenarios("frozenlake", "train", 30, seed=0)
    lake = {"frozenlake": {"size": 4, "p_frozen": 0.8, "max_steps": 12, "is_slippery": False}}
    free = baseline_report(train[:20], train, lake, seeds=(0,))
    budget = baseline_report(train[:20], train, lake, seeds=(0,), max_turns=5)
    assert free["train_lookup"]["mean"] == 1.0 and free["heuristics"]["down_right_rule"]["mean"] > 0.5
    assert budget["train_lookup"]["mean"] == budget["heuristics"]["down_right_rule"]["mean"] == 0.0
    assert baseline_report(train[:20], train, lake, seeds=(0,), max_turns=6)["train_lookup"]["mean"] == 1.0
