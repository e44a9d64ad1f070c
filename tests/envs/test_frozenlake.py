"""FrozenLakeText: observations, dynamics, solver, anchors, and scenario sets."""
from __future__ import annotations

import hashlib

import pytest

from envs import ENVS, Scenario, make_env, make_scenario_env, make_scenarios, register_env
from envs.frozenlake import ACTIONS, FrozenLakeText, shortest_path_actions
from envs.scenarios import SPLIT_SEED_RANGE, expert_trajectory


def grid(obs: str) -> list[list[str]]:
    return [line.split(" ") for line in obs.split("\n")]


def agent_cell(obs: str) -> tuple[int, int]:
    cells = [(r, c) for r, row in enumerate(grid(obs)) for c, cell in enumerate(row) if cell == "P"]
    assert len(cells) == 1, obs
    return cells[0]


def first_seed_where(predicate, **kwargs) -> tuple[FrozenLakeText, str, dict]:
    for seed in range(2000):
        env = FrozenLakeText(**kwargs)
        obs, info = env.reset(seed=seed)
        if predicate(grid(obs)):
            return env, obs, info
    raise AssertionError("no seed satisfied the predicate")


def test_registered_and_observation_format():
    assert ENVS["frozenlake"] is FrozenLakeText
    env = make_env("frozenlake")
    obs, info = env.reset(seed=3)
    rows = grid(obs)
    assert len(rows) == 4 and all(len(r) == 4 for r in rows)
    assert all(line == " ".join(line.split(" ")) and len(line) == 7 for line in obs.split("\n"))
    assert rows[0][0] == "P" and rows[3][3] == "G"
    assert set(c for r in rows for c in r) <= {"P", "F", "H", "G"}
    assert info["admissible_actions"] == ["left", "down", "right", "up"]
    assert info["action_valid"] is True and info["won"] is False
    assert env.task_description() == "Reach G without stepping on H. Moves: left, down, right, up."


def test_same_seed_same_map_and_observations():
    actions = ["right", "down", "jump", "down", "right", "up", "left"]
    runs = []
    for _ in range(2):
        env = FrozenLakeText(max_steps=50)
        obs, info = env.reset(seed=1234)
        seq = [(obs, info["anchor"])]
        for a in actions:
            obs, r, term, trunc, info = env.step(a)
            seq.append((obs, r, term, trunc, info["anchor"]))
            if term or trunc:
                break
        runs.append(seq)
    assert runs[0] == runs[1]
    maps = {FrozenLakeText().reset(seed=s)[1]["map_id"] for s in range(30)}
    assert len(maps) > 20  # different seeds, (mostly) different maps


def test_slippery_is_seeded():
    def play():
        env = FrozenLakeText(is_slippery=True, max_steps=30)
        obs, _ = env.reset(seed=77)
        out = [obs]
        for _ in range(10):
            obs, _, term, trunc, _ = env.step("right")
            out.append(obs)
            if term or trunc:
                break
        return out

    assert play() == play()


def test_stepping_into_a_hole_terminates_without_reward():
    env, obs, _ = first_seed_where(lambda g: g[1][0] == "H")
    obs, reward, terminated, truncated, info = env.step("down")
    assert (reward, terminated, truncated, info["won"]) == (0.0, True, False, False)
    assert agent_cell(obs) == (1, 0)
    assert info["anchor"].endswith(":1,0")
    with pytest.raises(RuntimeError, match="reset"):
        env.step("up")


def test_following_the_expert_reaches_the_goal():
    env = FrozenLakeText()
    obs, info = env.reset(seed=5)
    total, terminated, truncated = 0.0, False, False
    while not (terminated or truncated):
        obs, reward, terminated, truncated, info = env.step(env.expert_action())
        total += reward
    assert terminated and not truncated and info["won"] and total == 1.0
    assert agent_cell(obs) == (3, 3)
    assert env.expert_action() is None  # nothing to do once done


def test_truncation_at_max_steps_counts_invalid_actions():
    env = FrozenLakeText(max_steps=3, invalid_penalty=0.1)
    obs0, _ = env.reset(seed=0)
    obs, r, term, trunc, info = env.step("jump")
    assert (obs, r, term, trunc, info["action_valid"]) == (obs0, -0.1, False, False, False)
    obs, r, term, trunc, info = env.step("left")  # into the wall: a valid action that does not move
    assert (obs, r, term, trunc, info["action_valid"]) == (obs0, 0.0, False, False, True)
    obs, r, term, trunc, info = env.step("")
    assert (term, trunc, info["action_valid"], info["steps"]) == (False, True, False, 3)


def test_invalid_penalty_zero_gives_plain_zero_reward():
    env = FrozenLakeText()
    env.reset(seed=0)
    _, reward, _, _, info = env.step("north")
    assert reward == 0.0 and str(reward) == "0.0" and not info["action_valid"]


def test_anchor_is_map_id_row_col_and_stable():
    a, b = FrozenLakeText(), FrozenLakeText(max_steps=99)
    obs_a, info_a = a.reset(seed=42)
    _, info_b = b.reset(seed=42)
    desc = ["".join("S" if c == "P" else c for c in row) for row in grid(obs_a)]
    assert info_a["map_id"] == hashlib.sha1("\n".join(desc).encode()).hexdigest()[:8]
    assert info_a["anchor"] == info_b["anchor"] == f"{info_a['map_id']}:0,0"
    hash(info_a["anchor"])
    # coming back to a cell gives the same anchor
    _, _, _, _, i1 = a.step("right") if grid(obs_a)[0][1] != "H" else a.step("down")
    _, _, _, _, i2 = a.step("left") if i1["anchor"].endswith("0,1") else a.step("up")
    assert i2["anchor"] == info_a["anchor"]


def test_reset_options_override_size_and_reject_unknown_keys():
    env = FrozenLakeText()
    obs, _ = env.reset(seed=1, options={"size": 6, "p_frozen": 0.9})
    assert len(grid(obs)) == 6 and len(grid(obs)[0]) == 6
    with pytest.raises(ValueError, match="valid options"):
        env.reset(seed=1, options={"sise": 6})
    with pytest.raises(RuntimeError, match="reset"):
        FrozenLakeText().step("left")


def test_a_size_list_mixes_map_sizes_by_seed_and_bad_sizes_are_refused():
    env = FrozenLakeText(size=[4, 5])
    sizes = [len(grid(env.reset(seed=seed)[0])) for seed in range(6)]
    assert sizes == [4, 5, 4, 5, 4, 5]
    assert grid(env.reset(seed=1)[0]) == grid(FrozenLakeText(size=5).reset(seed=1)[0])  # the same map as plain 5x5
    assert len(grid(env.reset(seed=1, options={"size": 3})[0])) == 3
    for bad in ([], [4, 1], 1, [4.0], True):
        with pytest.raises(ValueError, match="size must be >= 2: an int, or a non-empty list of ints"):
            FrozenLakeText(size=bad)


def test_shortest_path_breaks_ties_in_action_order_and_avoids_holes():
    desc = ["SFF", "FHF", "FFG"]
    assert shortest_path_actions(desc, 0, 0) == ["down", "down", "right", "right"]
    assert shortest_path_actions(["SH", "HG"], 0, 0) is None
    assert set(shortest_path_actions(["SFFF", "HHHF", "FFFF", "FHHG"], 0, 0)) <= set(ACTIONS)


def test_solver_solves_every_generated_scenario():
    scenarios = make_scenarios("frozenlake", "train", 200, seed=0)
    for scenario in scenarios:
        steps = expert_trajectory(scenario)  # raises unless won
        assert 6 <= len(steps) <= 12
        assert all(action in ACTIONS for _, _, action in steps)


def test_expert_trajectory_errors_say_what_to_do():
    scenario = make_scenarios("frozenlake", "train", 1, seed=0)[0]
    with pytest.raises(ValueError, match="raise max_steps"):
        expert_trajectory(scenario, max_steps=2)
    assert len(expert_trajectory(scenario, require_win=False, max_steps=2)) == 2

    name = "_test_no_solver_env"

    @register_env(name)
    class NoSolver(FrozenLakeText):
        def expert_action(self):
            return None

    try:
        with pytest.raises(ValueError, match="unsolvable"):
            expert_trajectory(Scenario(env=name, seed=0, split="train"))
    finally:
        ENVS.pop(name)


def test_scenario_splits_are_disjoint_unique_and_deterministic():
    train = make_scenarios("frozenlake", "train", 500, seed=7)
    heldout = make_scenarios("frozenlake", "heldout", 500, seed=7)
    assert len({s.seed for s in train}) == 500 and len({s.seed for s in heldout}) == 500
    assert not {s.seed for s in train} & {s.seed for s in heldout}
    assert all(0 <= s.seed < SPLIT_SEED_RANGE for s in train)
    assert all(SPLIT_SEED_RANGE <= s.seed < 2 * SPLIT_SEED_RANGE for s in heldout)
    assert make_scenarios("frozenlake", "train", 500, seed=7) == train
    assert make_scenarios("frozenlake", "train", 5, seed=8) != train[:5]
    assert all(s.split == "train" and s.env == "frozenlake" for s in train)


def test_scenario_options_round_trip_and_bad_names():
    (s,) = make_scenarios("frozenlake", "heldout", 1, seed=0, options={"size": 5})
    assert s.options == (("size", 5),) and Scenario.from_json(s.to_json()) == s
    _, obs, _ = make_scenario_env(s)
    assert len(grid(obs)) == 5
    with pytest.raises(ValueError, match="valid splits"):
        make_scenarios("frozenlake", "test", 1, seed=0)
    with pytest.raises(KeyError, match="registered envs"):
        make_scenarios("nope", "train", 1, seed=0)
