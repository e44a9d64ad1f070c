"""CountdownText: move rules, hand-checked dynamics and solver plans, generation, anchors, truncation."""
from __future__ import annotations

import pytest

from envs import ENVS, make_env, make_scenarios
from envs.countdown import (CountdownSolver, CountdownText, apply_op, combine, generate_instance, legal_moves,
                            parse_move)
from envs.scenarios import expert_trajectory


def given(numbers, target, **kwargs) -> tuple[CountdownText, str, dict]:
    env = CountdownText(**kwargs)
    obs, info = env.reset(options={"numbers": numbers, "target": target})
    return env, obs, info


def test_registered_and_observation_format():
    assert ENVS["countdown"] is CountdownText
    env = make_env("countdown")
    obs, info = env.reset(seed=4)
    target_line, numbers_line = obs.split("\n")
    assert target_line == f"target {info['target']}"
    assert numbers_line == "numbers " + " ".join(map(str, info["numbers"]))
    assert len(info["numbers"]) == 4 and info["numbers"] == sorted(info["numbers"])
    assert all(1 <= n <= 25 for n in info["numbers"]) and info["target"] not in info["numbers"]
    assert info["reachable"] and not info["won"]


def test_op_rules_only_positive_integers():
    assert [apply_op(6, op, 4) for op in "+-*/"] == [10, 2, 24, None]
    assert apply_op(4, "-", 6) is None and apply_op(4, "-", 4) is None and apply_op(8, "/", 4) == 2
    assert apply_op(3, "^", 2) is None


def test_admissible_actions_hand_checked_and_deduped():
    _, _, info = given([6, 2, 3], 100)
    assert info["admissible_actions"] == ["3 + 2", "3 - 2", "3 * 2", "6 + 2", "6 - 2", "6 * 2", "6 / 2",
                                          "6 + 3", "6 - 3", "6 * 3", "6 / 3"]
    assert [f"{a} {op} {b}" for a, op, b in legal_moves((3, 3))] == ["3 + 3", "3 * 3", "3 / 3"]


def test_parse_move_accepts_commuted_and_rejects_unavailable():
    nums = (2, 3, 6)
    assert parse_move("2 + 3", nums) == (3, "+", 2) == parse_move(" 3+2 ", nums)
    assert parse_move("2 * 6", nums) == (6, "*", 2)
    for bad in ["3 - 6", "6 / 4", "3 / 2", "3 + 3", "3 + 5", "add 3 5", "3 ^ 2", "", "3 +", "-3 + 2"]:
        assert parse_move(bad, nums) is None, bad
    assert parse_move("3 - 3", (3, 3)) is None  # zero is not allowed
    assert parse_move("3 / 3", (3, 3)) == (3, "/", 3)


def test_winning_move_hand_checked():
    env, obs, _ = given([2, 3, 6], 12)
    assert obs == "target 12\nnumbers 2 3 6"
    obs, reward, terminated, truncated, info = env.step("6 * 2")
    assert obs == "target 12\nnumbers 3 12"
    assert (reward, terminated, truncated, info["won"], info["action_valid"]) == (1.0, True, False, True, True)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("12 + 3")


def test_losing_when_one_number_is_left():
    env, _, _ = given([2, 3, 6], 9)
    obs, reward, terminated, _, info = env.step("2 + 3")
    assert obs == "target 9\nnumbers 5 6" and (reward, terminated) == (0.0, False)
    assert not info["reachable"]  # 11, 1, 30: none is 9
    assert env.expert_action() is None
    obs, reward, terminated, truncated, info = env.step("6 - 5")
    assert obs == "target 9\nnumbers 1" and (reward, terminated, truncated, info["won"]) == (0.0, True, False, False)
    assert info["admissible_actions"] == []


def test_solver_shortest_plan_with_fixed_tie_break():
    solver = CountdownSolver(36)
    # both 3*2 then 6*6 and 6*3 then 18*2 take two moves: the first legal move in order (3*2) wins the tie
    assert solver.plan((2, 3, 6)) == [(3, "*", 2), (6, "*", 6)]
    assert CountdownSolver(12).plan((2, 3, 6)) == [(6, "*", 2)]
    assert CountdownSolver(6).plan((2, 3, 6)) == []
    assert CountdownSolver(5).plan((1, 1)) is None
    assert CountdownSolver(7).plan((1, 1, 1)) is None  # max is (1+1)+1 = 3


def test_expert_follows_plan_and_replans():
    env, _, _ = given([2, 3, 6], 36)
    assert env.expert_action() == "3 * 2"
    env.step("6 * 3")  # off the expert's plan, still solvable: 18 * 2
    assert env.expert_action() == "18 * 2"
    _, reward, terminated, _, info = env.step(env.expert_action())
    assert (reward, terminated, info["won"]) == (1.0, True, True)


def test_generation_deterministic_and_targets_need_two_moves():
    assert generate_instance(77, 4, 25) == generate_instance(77, 4, 25)
    assert len({generate_instance(s, 4, 25) for s in range(30)}) == 30
    for seed in range(40):
        numbers, target = generate_instance(seed, 4, 25)
        plan = CountdownSolver(target).plan(numbers)
        assert plan is not None and 2 <= len(plan) <= 3 and target not in numbers and target <= 999
        for move in plan:
            numbers = combine(numbers, move)
        assert target in numbers


@pytest.mark.parametrize("options", [{}, {"num_numbers": 5}])
def test_expert_wins_every_scenario_of_both_splits(options):
    for split in ("train", "heldout"):
        for scenario in make_scenarios("countdown", split, 50, seed=0, options=options):
            steps = expert_trajectory(scenario)  # raises unless won
            assert 2 <= len(steps) <= options.get("num_numbers", 4) - 1


def test_seeded_determinism_of_transcripts():
    def run():
        env = CountdownText()
        out = [env.reset(seed=321)]
        for action in ["bogus", env.expert_action(), "1 + 1"]:
            out.append(env.step(action))
        return out

    assert run() == run()


def test_invalid_actions_and_truncation():
    env, obs0, info0 = given([2, 3, 6, 7], 500, max_steps=3, invalid_penalty=0.5)
    obs, reward, terminated, truncated, info = env.step("7 - 9")
    assert (obs, reward, terminated, truncated, info["action_valid"]) == (obs0, -0.5, False, False, False)
    assert info["anchor"] == info0["anchor"] and info["numbers"] == [2, 3, 6, 7]
    _, _, _, _, info = env.step(None)
    assert not info["action_valid"]
    _, reward, terminated, truncated, info = env.step("7 + 6")
    assert (reward, terminated, truncated, info["steps"], info["numbers"]) == (0.0, False, True, 3, [2, 3, 13])


def test_anchor_is_target_and_sorted_multiset():
    a, _, info0 = given([4, 1, 3, 2], 50)
    assert info0["anchor"] == "50:1,2,3,4"
    b, _, _ = given([1, 2, 3, 4], 50)
    _, _, _, _, info_a = a.step("3 * 1")
    _, _, _, _, info_b = b.step("4 / 1")
    assert info_a["anchor"] == info_b["anchor"] == "50:2,3,4"


def test_full_verbosity_shows_last_move():
    env, obs, _ = given([2, 3, 6], 36, verbosity="full")
    assert obs.split("\n")[-1] == "last -, moves left 6"
    obs, _, _, _, _ = env.step("6 * 3")
    assert obs == "target 36\nnumbers 2 18\nlast 6 * 3 = 18, moves left 5"


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="valid options"):
        CountdownText().reset(seed=0, options={"nums": [1, 2]})
    with pytest.raises(ValueError, match="go together"):
        CountdownText().reset(seed=0, options={"numbers": [1, 2]})
    with pytest.raises(ValueError, match="not among"):
        given([3, 4], 4)
    with pytest.raises(ValueError, match="num_numbers"):
        CountdownText().reset(seed=0, options={"num_numbers": 7})
    with pytest.raises(ValueError, match="verbosity"):
        CountdownText(verbosity="loud")
