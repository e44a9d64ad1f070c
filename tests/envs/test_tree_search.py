"""TreeSearchText: moves and backtracking, hint statistics, expert, depth curriculum, anchors, truncation."""
from __future__ import annotations

import pytest

from envs import ENVS, make_env, make_scenarios
from envs.scenarios import expert_trajectory
from envs.tree_search import TreeSearchText, draw_goal, draw_hint, expert_path, parse_action


def high_child(obs: str) -> int:
    signal = obs.split("\n")[1]
    assert signal.startswith("signal: "), obs
    highs = [int(part.split()[0]) for part in signal[len("signal: "):].split(", ") if part.endswith("high")]
    assert len(highs) == 1, obs
    return highs[0]


def test_registered_and_observation_format():
    assert ENVS["tree_search"] is TreeSearchText
    env = make_env("tree_search")
    obs, info = env.reset(seed=0)
    lines = obs.split("\n")
    assert lines[0] == "node root, depth 0 of 3" and len(lines) == 2
    assert lines[1] in {f"signal: {', '.join(f'{i} high' if i == h else f'{i} low' for i in (1, 2, 3))}"
                        for h in (1, 2, 3)}
    assert info["admissible_actions"] == ["child 1", "child 2", "child 3"]
    assert info["anchor"] == f"{info['tree_id']}:root" and info["depth"] == 3


def test_hand_walk_with_dead_end_backtracking_and_goal():
    env = TreeSearchText(branching=2, depth=2)
    env.reset(seed=5)
    goal = draw_goal(5, 2, 2)
    wrong = 3 - goal[1]
    obs, reward, terminated, _, info = env.step(f"child {goal[0]}")
    assert obs.split("\n")[0] == f"node {goal[0]}, depth 1 of 2" and (reward, terminated) == (0.0, False)
    assert info["admissible_actions"] == ["child 1", "child 2", "back"]
    obs, reward, terminated, _, info = env.step(f"child {wrong}")
    assert obs == f"node {goal[0]}-{wrong}, depth 2 of 2\ndead end" and (reward, terminated) == (0.0, False)
    assert info["admissible_actions"] == ["back"]
    _, _, _, _, info = env.step(f"child {wrong}")  # no children below a leaf
    assert not info["action_valid"] and info["anchor"].endswith(f":{goal[0]}-{wrong}")
    env.step("back")
    obs, reward, terminated, truncated, info = env.step(f"child {goal[1]}")
    assert obs == f"node {goal[0]}-{goal[1]}, depth 2 of 2\ngoal found"
    assert (reward, terminated, truncated, info["won"], info["steps"]) == (1.0, True, False, True, 5)
    assert env.expert_action() is None
    with pytest.raises(RuntimeError, match="reset"):
        env.step("back")


def test_expert_path_hand_checked():
    assert expert_path((1, 2), (2, 1)) == ["back", "back", "child 2", "child 1"]
    assert expert_path((2,), (2, 3, 1)) == ["child 3", "child 1"]
    assert expert_path((2, 3, 2), (2, 3, 1)) == ["back", "child 1"]
    assert expert_path((), ()) == []


def test_parse_action():
    assert parse_action(" Child 2 ", 3) == 2 and parse_action("back", 3) == "back"
    for bad in ["child 4", "child 0", "child", "child two", "2", "go back", "", None]:
        assert parse_action(bad, 3) is None, bad


def test_hints_hit_the_goal_branch_at_the_stated_rate():
    for accuracy, low, high in [(0.8, 0.76, 0.84), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0)]:
        hits = sum(draw_hint(seed, (), draw_goal(seed, 3, 3), 3, accuracy) == draw_goal(seed, 3, 3)[0]
                   for seed in range(2000))
        assert low <= hits / 2000 <= high, (accuracy, hits)
    # off the goal's path the high child is uniform: no information
    off = [draw_hint(seed, (1,), (2, 1, 1), 3, 0.8) for seed in range(3000)]
    assert all(abs(off.count(i) / 3000 - 1 / 3) < 0.04 for i in (1, 2, 3))


def test_perfect_hints_lead_straight_to_the_goal():
    for seed in range(30):
        env = TreeSearchText(branching=3, depth=4, hint_accuracy=1.0)
        obs, _ = env.reset(seed=seed)
        for _ in range(4):
            obs, reward, terminated, _, info = env.step(f"child {high_child(obs)}")
        assert terminated and info["won"] and reward == 1.0


def test_hints_are_fixed_within_an_episode_and_per_seed():
    env = TreeSearchText()
    obs0, info0 = env.reset(seed=8)
    env.step("child 1")
    obs, _, _, _, info = env.step("back")
    assert (obs, info["anchor"]) == (obs0, info0["anchor"])
    assert TreeSearchText().reset(seed=8) == (obs0, info0)
    goals = {draw_goal(s, 3, 3) for s in range(200)}
    assert len(goals) == 27  # every leaf is a goal for some seed


@pytest.mark.parametrize("options", [{}, {"branching": 4, "depth": 5}])
def test_expert_wins_every_scenario_of_both_splits(options):
    for split in ("train", "heldout"):
        for scenario in make_scenarios("tree_search", split, 100, seed=0, options=options):
            steps = expert_trajectory(scenario)  # raises unless won
            assert len(steps) == options.get("depth", 3)  # straight down from the root


def test_invalid_actions_and_truncation_at_default_max_steps():
    env = TreeSearchText(invalid_penalty=0.1)  # max_steps = 2 * depth * branching = 18
    obs0, info0 = env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step("back")  # no parent at the root
    assert (obs, reward, terminated, truncated, info["action_valid"]) == (obs0, -0.1, False, False, False)
    assert info["anchor"] == info0["anchor"]
    for _ in range(16):
        _, _, terminated, truncated, info = env.step("child 7")
        assert not info["action_valid"] and not (terminated or truncated)
    _, _, terminated, truncated, info = env.step("jump")
    assert (terminated, truncated, info["steps"]) == (False, True, 18)


def test_anchor_is_tree_id_and_path():
    a, b = TreeSearchText(), TreeSearchText(max_steps=99)
    _, info_a = a.reset(seed=3)
    _, info_b = b.reset(seed=3)
    assert info_a["anchor"] == info_b["anchor"]
    _, _, _, _, info = a.step("child 2")
    _, _, _, _, info = a.step("child 3")
    assert info["anchor"] == f"{info_a['tree_id']}:2-3"
    assert TreeSearchText().reset(seed=4)[1]["tree_id"] != info_a["tree_id"]
    assert TreeSearchText(hint_accuracy=0.5).reset(seed=3)[1]["tree_id"] != info_a["tree_id"]


def test_depth_curriculum_draws_depth_per_seed():
    options = {"min_depth": 2, "max_depth": 5}
    depths = [TreeSearchText().reset(seed=s, options=options)[1]["depth"] for s in range(200)]
    assert set(depths) == {2, 3, 4, 5}
    assert depths == [TreeSearchText().reset(seed=s, options=options)[1]["depth"] for s in range(200)]
    env = TreeSearchText()
    obs, info = env.reset(seed=0, options={"depth": 6})
    assert obs.startswith("node root, depth 0 of 6") and info["depth"] == 6
    for _ in range(35):  # max_steps follows the episode's depth: 2 * 6 * 3 = 36
        env.step("nope")
    assert env.step("nope")[3] is True


def test_full_verbosity_lists_visited_children():
    env = TreeSearchText(verbosity="full")
    obs, _ = env.reset(seed=2)
    assert obs.split("\n")[-1] == "visited children: -, steps left 18"
    env.step("child 3")
    obs, _, _, _, _ = env.step("back")
    assert obs.split("\n")[-1] == "visited children: 3, steps left 16"


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="valid options"):
        TreeSearchText().reset(seed=0, options={"width": 3})
    with pytest.raises(ValueError, match="go together"):
        TreeSearchText().reset(seed=0, options={"min_depth": 2})
    with pytest.raises(ValueError, match="either"):
        TreeSearchText().reset(seed=0, options={"min_depth": 2, "max_depth": 3, "depth": 2})
    with pytest.raises(ValueError, match="min_depth <= max_depth"):
        TreeSearchText().reset(seed=0, options={"min_depth": 4, "max_depth": 3})
    with pytest.raises(ValueError, match="branching"):
        TreeSearchText(branching=10)
    with pytest.raises(ValueError, match="hint_accuracy"):
        TreeSearchText(hint_accuracy=1.5)
    with pytest.raises(ValueError, match="verbosity"):
        TreeSearchText(verbosity="loud")
