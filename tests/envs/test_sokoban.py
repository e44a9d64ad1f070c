"""SokobanText: generation, dynamics on hand-made levels, deadlocks, solver, anchors, truncation."""
from __future__ import annotations

import pytest

from envs import ENVS, make_env, make_scenarios
from envs.scenarios import expert_trajectory
from envs.sokoban import (ACTIONS, SokobanText, corner_deadlock, generate_puzzle, move, parse_level, render,
                          room_id, solve)

# A corridor: the player pushes the box right twice onto the target.
CORRIDOR = ("######",
            "#PX_O#",
            "#____#",
            "######")


def play(env: SokobanText, actions: list[str]) -> list[tuple]:
    out = []
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        out.append((obs, reward, terminated, truncated, info))
        if terminated or truncated:
            break
    return out


def test_registered_and_observation_legend():
    assert ENVS["sokoban"] is SokobanText
    env = make_env("sokoban")
    obs, info = env.reset(seed=3)
    rows = [line.split(" ") for line in obs.split("\n")]
    assert len(rows) == 6 and all(len(r) == 6 for r in rows)
    assert all(c == "#" for c in rows[0] + rows[-1] + [r[0] for r in rows] + [r[-1] for r in rows])
    cells = [c for r in rows for c in r]
    assert set(cells) <= set("#_OX*PS")
    assert cells.count("P") + cells.count("S") == 1
    assert cells.count("X") + cells.count("*") == 1 == cells.count("O") + cells.count("*") + cells.count("S")
    assert info["admissible_actions"] == list(ACTIONS)
    assert (info["won"], info["deadlock"], info["steps"], info["boxes_on_target"]) == (False, False, 0, 0)


def test_generation_is_deterministic_and_varies_with_seed():
    first = generate_puzzle(123, 6, 1, 20, 3)
    assert generate_puzzle(123, 6, 1, 20, 3) == first
    ids = {room_id(generate_puzzle(s, 6, 1, 20, 3)[0]) for s in range(30)}
    assert len(ids) > 20
    a, b = SokobanText(), SokobanText()
    assert a.reset(seed=99) == b.reset(seed=99)
    actions = ["up", "left", "jump", "down", "right", "right", "up"]
    assert play(a, actions) == play(b, actions)


@pytest.mark.parametrize("dim,num_boxes", [(6, 1), (7, 2)])
def test_generated_puzzles_are_solvable_within_bounds(dim, num_boxes):
    for seed in range(60):
        room, player, boxes, solution = generate_puzzle(seed, dim, num_boxes, 20, 3)
        assert len(boxes) == num_boxes and not boxes <= room.targets
        assert 3 <= len(solution) <= 20
        for action in solution:  # replaying the solution really solves it
            player, boxes = move(room, player, boxes, action)
        assert boxes == room.targets


@pytest.mark.parametrize("options", [{}, {"dim": 7, "num_boxes": 2}])
def test_expert_wins_every_scenario_of_both_splits(options):
    for split in ("train", "heldout"):
        for scenario in make_scenarios("sokoban", split, 100, seed=0, options=options):
            steps = expert_trajectory(scenario)  # raises unless won
            assert 3 <= len(steps) <= 20


def test_max_steps_bounds_the_generated_solution_length():
    for seed in range(20):
        env = SokobanText(max_steps=4)
        env.reset(seed=seed)
        n = 0
        while env.expert_action() is not None:
            _, _, terminated, truncated, info = env.step(env.expert_action())
            n += 1
        assert info["won"] and n <= 4


def test_hand_made_level_push_and_win():
    env = SokobanText(box_reward=0.5)
    obs, info = env.reset(options={"level": CORRIDOR})
    assert obs == "# # # # # #\n# P X _ O #\n# _ _ _ _ #\n# # # # # #"
    obs, reward, terminated, truncated, info = env.step("right")
    assert obs.split("\n")[1] == "# _ P X O #" and (reward, terminated) == (0.0, False)
    assert info["anchor"] == f"{info['puzzle_id']}:1,2:1,3"
    obs, reward, terminated, truncated, info = env.step("right")
    assert obs.split("\n")[1] == "# _ _ P * #"
    assert (reward, terminated, truncated, info["won"], info["boxes_on_target"]) == (1.5, True, False, True, 1)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("left")


def test_blocked_moves_are_valid_no_ops_and_box_reward_is_signed():
    level = ("#######",
             "#_____#",
             "#P*XO_#",
             "#_____#",
             "#######")
    env = SokobanText(box_reward=0.25)
    obs0, info0 = env.reset(options={"level": level})
    assert info0["boxes_on_target"] == 1
    obs, reward, _, _, info = env.step("left")  # wall
    assert (obs, reward, info["action_valid"], info["anchor"]) == (obs0, 0.0, True, info0["anchor"])
    obs, reward, _, _, info = env.step("right")  # box into box: blocked
    assert (obs, reward, info["action_valid"], info["anchor"]) == (obs0, 0.0, True, info0["anchor"])
    env.step("down")
    env.step("right")
    obs, reward, terminated, _, info = env.step("up")  # push the box off its target, player onto it
    assert obs.split("\n")[1:3] == ["# _ X _ _ _ #", "# _ S X O _ #"]
    assert (reward, terminated, info["boxes_on_target"]) == (-0.25, False, 0)
    obs, reward, terminated, _, info = env.step("right")  # push the other box onto the other target
    assert obs.split("\n")[2] == "# _ O P * _ #"
    assert (reward, terminated, info["won"], info["boxes_on_target"]) == (0.25, False, False, 1)


def test_corner_deadlock_terminates_as_lost():
    env = SokobanText()
    env.reset(options={"level": ("######", "#__X_#", "#___P#", "#___O#", "######")})
    env.step("up")
    obs, reward, terminated, truncated, info = env.step("left")  # along the top wall: not a corner
    assert obs.split("\n")[1] == "# _ X P _ #" and not terminated and not info["deadlock"]
    obs, reward, terminated, truncated, info = env.step("left")  # pushed into the top-left corner
    assert obs.split("\n")[1] == "# X P _ _ #"
    assert (reward, terminated, truncated, info["won"], info["deadlock"]) == (0.0, True, False, False, True)
    room, _, boxes = parse_level(("#####", "#X__#", "#_P_#", "#__O#", "#####"))
    assert corner_deadlock(room, boxes)
    assert solve(room, (2, 2), boxes) is None


def test_solver_shortest_with_fixed_tie_break():
    room, player, boxes = parse_level(CORRIDOR)
    assert solve(room, player, boxes) == ["right", "right"]
    room, player, boxes = parse_level(("######", "#__O_#", "#_X__#", "#_P__#", "######"))
    # hand-checked: push up, walk round to the box's left, push right (pushing right first takes 6)
    assert solve(room, player, boxes) == ["up", "left", "up", "right"]
    assert solve(room, player, boxes, max_len=3) is None


def test_expert_replans_after_a_detour():
    env = SokobanText()
    env.reset(options={"level": CORRIDOR})
    env.step("down")
    assert env.expert_action() == "up"
    env.step("up")
    assert env.expert_action() == "right"


def test_invalid_actions_and_truncation():
    env = SokobanText(max_steps=3, invalid_penalty=0.1)
    obs0, info0 = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("jump")
    assert (obs, reward, terminated, truncated, info["action_valid"]) == (obs0, -0.1, False, False, False)
    assert info["anchor"] == info0["anchor"]
    _, reward, _, _, info = env.step(None)  # not even a string: still just invalid
    assert not info["action_valid"]
    _, _, terminated, truncated, info = env.step("UP ")  # case and spaces are forgiven
    assert info["action_valid"] and (terminated, truncated, info["steps"]) == (False, True, 3)
    with pytest.raises(RuntimeError, match="reset"):
        SokobanText().step("up")


def test_anchor_same_state_same_anchor():
    env = SokobanText()
    _, info0 = env.reset(options={"level": CORRIDOR})
    env.step("down")
    _, _, _, _, info = env.step("up")
    assert info["anchor"] == info0["anchor"] == f"{info0['puzzle_id']}:1,1:1,2"
    other = SokobanText(max_steps=50)
    assert other.reset(options={"level": CORRIDOR})[1]["anchor"] == info0["anchor"]


def test_full_verbosity_and_render():
    env = SokobanText(verbosity="full")
    obs, _ = env.reset(options={"level": CORRIDOR})
    assert obs.split("\n")[-1] == "boxes on target 0/1, steps left 20"
    room, player, boxes = parse_level(CORRIDOR)
    assert render(room, player, boxes) == obs.rsplit("\n", 1)[0]


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="valid options"):
        SokobanText().reset(seed=0, options={"size": 6})
    with pytest.raises(ValueError, match="num_boxes"):
        SokobanText(num_boxes=9)
    with pytest.raises(ValueError, match="dim must be"):
        SokobanText().reset(seed=0, options={"dim": 3})
    with pytest.raises(ValueError, match="legend"):
        SokobanText().reset(options={"level": ("####", "#P?#", "####")})
    with pytest.raises(ValueError, match="as many boxes as targets"):
        SokobanText().reset(options={"level": ("#####", "#PXX#", "#O__#", "#####")})
    with pytest.raises(ValueError, match="border"):
        SokobanText().reset(options={"level": ("#####", "#PXO_", "#####")})
    with pytest.raises(ValueError, match="verbosity"):
        SokobanText(verbosity="loud")
