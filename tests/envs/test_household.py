"""HouseholdText: generation, dynamics on a hand-built home, subgoals, splits, anchors, the expert everywhere, and
the rules against ALFWorld's PDDL preconditions and effects."""
from __future__ import annotations

import copy
import random

import pytest

from envs import ENVS, make_env, make_scenarios
from envs import household_world as hw
from envs.household import HouseholdText, admissible_actions
from envs.household_world import Task, World
from envs.scenarios import expert_trajectory

RECEP_ROOM = {"cabinet 1": "kitchen", "countertop 1": "kitchen", "fridge 1": "kitchen", "microwave 1": "kitchen",
              "sinkbasin 1": "kitchen", "desk 1": "bedroom", "shelf 1": "bedroom", "shelf 2": "bedroom"}
INITIAL = {"apple 1": "fridge 1", "mug 1": "countertop 1", "book 1": "shelf 1", "cd 1": "cabinet 1",
           "cd 2": "desk 1", "cd 3": "shelf 1"}


def tiny(task_type: str, obj_type: str, target_type: str | None) -> HouseholdText:
    """An env reset into a fixed two-room home (kitchen + bedroom with two shelves, one desk lamp on desk 1)."""
    task = Task(task_type=task_type, obj_type=obj_type, target_type=target_type or hw.LAMP_TARGET,
                count=2 if task_type == "pick_two_obj_and_place" else 1, process=hw.PROCESS_OF_TASK.get(task_type))
    world = World(world_id="tiny0000", rooms=("kitchen", "bedroom"), templates=(0, 0),
                  receptacles=tuple(RECEP_ROOM), recep_room=RECEP_ROOM, lamps={"desklamp 1": "desk 1"},
                  initial=dict(INITIAL), start_room="kitchen", task=task)
    env = HouseholdText(max_steps=40)
    env.reset_to_world(world)
    return env


def run(env: HouseholdText, actions: list[str]) -> list[tuple]:
    return [env.step(a) for a in actions]


def play_expert(env: HouseholdText, info: dict) -> dict:
    done = False
    while not done:
        action = env.expert_action()
        assert action in info["admissible_actions"], (action, info["admissible_actions"])
        _, _, terminated, truncated, info = env.step(action)
        done = terminated or truncated
    return info


def test_registered_first_observation_and_task_text():
    assert ENVS["household"] is HouseholdText and HouseholdText.split_aware is True
    env = tiny("pick_clean_then_place", "mug", "shelf")
    obs, info = env.reset_to_world(env.world)
    assert obs == ("You are in the middle of the kitchen. Around you: cabinet 1, countertop 1, fridge 1, "
                   "microwave 1, sinkbasin 1. Other rooms: bedroom.")
    assert env.task_description() == "Your task is to: put a clean mug in shelf."  # a type, as in ALFWorld
    texts = [tiny("pick_and_place", "apple", "cabinet").task_description(),
             tiny("pick_heat_then_place", "egg", "cabinet").task_description(),
             tiny("pick_cool_then_place", "apple", "shelf").task_description(),
             tiny("pick_two_obj_and_place", "cd", "desk").task_description(),
             tiny("look_at_obj_in_light", "book", None).task_description()]
    assert texts == ["Your task is to: put an apple in cabinet.", "Your task is to: put a hot egg in cabinet.",
                     "Your task is to: put a cool apple in shelf.", "Your task is to: put two cd in desk.",
                     "Your task is to: examine the book with the desklamp."]
    assert info["subgoals"] == ["take mug", "clean mug", "put mug in shelf"]
    assert (info["subgoals_done"], info["subgoals_total"], info["task_type"]) == (0, 3, "pick_clean_then_place")
    assert info["admissible_actions"] == sorted(["inventory", "look"] + [f"go to {r}" for r in RECEP_ROOM])
    obs, *_ = env.step("go to desk 1")
    assert obs == "You are in the bedroom at desk 1. On it: desklamp 1, cd 2."


def test_generation_is_deterministic_and_varied():
    def transcript(seed):
        env = make_env("household", rooms=3)
        obs, info = env.reset(seed=seed, options={"split": "heldout"})
        out = [obs, env.task_description(), info["anchor"]]
        rng = random.Random(0)
        for _ in range(15):
            obs, reward, terminated, truncated, info = env.step(rng.choice(info["admissible_actions"]))
            out.append((obs, reward, info["anchor"], info["admissible_actions"]))
            if terminated or truncated:
                break
        return out

    assert transcript(5) == transcript(5)
    worlds = {HouseholdText().reset(seed=s)[1]["world_id"] for s in range(40)}
    assert len(worlds) == 40
    types = {HouseholdText().reset(seed=s)[1]["task_type"] for s in range(60)}
    assert types == set(hw.TASK_TYPES)


def test_closed_receptacles_hide_and_block_until_opened():
    env = tiny("pick_and_place", "apple", "shelf")
    obs, _, _, _, info = env.step("go to fridge 1")
    assert obs == "You are in the kitchen at fridge 1. The fridge 1 is closed."
    assert "take apple 1 from fridge 1" not in info["admissible_actions"]
    assert "open fridge 1" in info["admissible_actions"]
    obs, _, _, _, info = env.step("take apple 1 from fridge 1")
    assert info["action_valid"] is False and obs == "Nothing happens. The fridge 1 is closed."
    assert env.state.held is None
    obs, _, _, _, info = env.step("open fridge 1")
    assert obs == "You open the fridge 1. In it: apple 1." and "close fridge 1" in info["admissible_actions"]
    obs, _, _, _, info = env.step("take apple 1 from fridge 1")
    assert info["action_valid"] and env.state.held == "apple 1" and info["subgoals_done"] == 1
    env.step("close fridge 1")
    _, _, _, _, info = env.step("put apple 1 in fridge 1")
    assert info["action_valid"] is False  # closed again: cannot put either


def test_carrying_capacity_is_one_object():
    env = tiny("pick_and_place", "mug", "shelf")
    run(env, ["go to shelf 1", "take book 1 from shelf 1"])
    obs, _, _, _, info = env.step("take cd 3 from shelf 1")
    assert info["action_valid"] is False and "carry one object" in obs
    assert not any(a.startswith("take") for a in info["admissible_actions"])
    assert "put book 1 in shelf 1" in info["admissible_actions"]
    assert env.step("inventory")[0] == "You are carrying: book 1."


def test_clean_heat_cool_change_object_state():
    env = tiny("pick_heat_then_place", "mug", "shelf")
    run(env, ["go to countertop 1", "take mug 1 from countertop 1", "go to microwave 1"])
    assert env.step("examine mug 1")[0] == "This is a normal mug 1."
    obs, *_ = env.step("heat mug 1 with microwave 1")
    assert obs == "You heat the mug 1 using the microwave 1." and env.step("examine mug 1")[0] == "The mug 1 is hot."
    run(env, ["go to fridge 1", "cool mug 1 with fridge 1"])  # cooling undoes heating
    assert env.step("examine mug 1")[0] == "The mug 1 is cold."
    run(env, ["go to sinkbasin 1", "clean mug 1 with sinkbasin 1"])
    assert env.step("examine mug 1")[0] == "The mug 1 is clean and cold."
    _, _, _, _, info = env.step("clean mug 1 with microwave 1")
    assert info["action_valid"] is False
    # a book cannot be heated: the action is not admissible at the microwave
    env2 = tiny("pick_and_place", "book", "desk")
    _, _, _, _, info = env2.step("go to shelf 1")
    _, _, _, _, info = run(env2, ["take book 1 from shelf 1", "go to microwave 1"])[-1]
    assert not any(a.startswith("heat") for a in info["admissible_actions"])


def test_process_then_place_needs_the_processed_object():
    env = tiny("pick_cool_then_place", "apple", "shelf")
    results = run(env, ["go to fridge 1", "open fridge 1", "take apple 1 from fridge 1", "go to shelf 1",
                        "put apple 1 in shelf 1"])
    assert [r[4]["subgoals_done"] for r in results] == [0, 0, 1, 1, 1] and not results[-1][4]["won"]
    results = run(env, ["take apple 1 from shelf 1", "cool apple 1 with fridge 1", "go to fridge 1",
                        "cool apple 1 with fridge 1", "go to shelf 1", "put apple 1 on shelf 1"])
    assert [r[4]["action_valid"] for r in results] == [True, False, True, True, True, True]
    assert [r[4]["subgoals_done"] for r in results] == [1, 1, 1, 2, 2, 3]
    assert results[-1][1:4] == (1.0, True, False) and results[-1][4]["won"]


def test_examine_in_light_needs_the_object_in_hand_at_a_lit_lamp():
    env = tiny("look_at_obj_in_light", "book", None)
    obs, reward, terminated, _, info = env.step("go to desk 1")
    obs, reward, terminated, _, info = env.step("use desklamp 1")  # lit, but no book in hand
    assert obs == "You turn on the desklamp 1." and (reward, terminated, info["won"]) == (0.0, False, False)
    run(env, ["go to shelf 1", "take cd 3 from shelf 1", "go to desk 1"])  # wrong object under the lamp
    assert not env.step("examine cd 3")[4]["won"]
    run(env, ["go to shelf 1", "put cd 3 in shelf 1", "take book 1 from shelf 1"])
    assert env.step("examine book 1")[0] == "This is a normal book 1."
    obs, reward, terminated, _, info = env.step("go to desk 1")  # the lamp is still on: arriving wins
    assert (reward, terminated, info["won"], info["subgoals_done"]) == (1.0, True, True, 2)
    env = tiny("look_at_obj_in_light", "book", None)
    results = run(env, ["go to shelf 1", "take book 1 from shelf 1", "go to desk 1", "use desklamp 1"])
    assert [r[1] for r in results] == [0.0, 0.0, 0.0, 1.0] and results[-1][2]


def test_use_toggles_the_desklamp_and_only_a_lit_lamp_wins():
    env = tiny("look_at_obj_in_light", "book", None)
    results = run(env, ["go to desk 1", "use desklamp 1", "examine desklamp 1", "use desklamp 1",
                        "examine desklamp 1"])
    assert [r[0] for r in results[1:]] == ["You turn on the desklamp 1.", "The desklamp 1 is on.",
                                           "You turn off the desklamp 1.", "The desklamp 1 is off."]
    assert env.state.lamps_on == set() and "use desklamp 1" in results[-1][4]["admissible_actions"]
    results = run(env, ["go to shelf 1", "take book 1 from shelf 1", "go to desk 1"])
    assert not results[-1][4]["won"] and env.expert_action() == "use desklamp 1"  # the lamp is off: no win
    assert env.step("use desklamp 1")[1:4] == (1.0, True, False)
    env = tiny("look_at_obj_in_light", "book", None)  # switched on and off again before the book comes
    run(env, ["go to desk 1", "use desklamp 1", "use desklamp 1", "go to shelf 1", "take book 1 from shelf 1"])
    assert not env.step("go to desk 1")[4]["won"] and hw.lit_here(env.world, env.state) is False


def test_examine_receptacle_describes_it_where_the_agent_is():
    env = tiny("pick_and_place", "apple", "shelf")
    _, _, _, _, info = env.step("go to fridge 1")
    assert "examine fridge 1" in info["admissible_actions"]
    assert not any(a.startswith("examine") and a != "examine fridge 1" for a in info["admissible_actions"])
    obs, _, _, _, info = env.step("examine fridge 1")
    assert info["action_valid"] and obs == "You examine the fridge 1. The fridge 1 is closed."
    env.step("open fridge 1")
    assert env.step("examine fridge 1")[0] == "You examine the fridge 1. The fridge 1 is open. In it: apple 1."
    obs, _, _, _, info = env.step("examine shelf 1")  # not here: not admissible
    assert info["action_valid"] is False and obs == "Nothing happens. Go to the shelf 1 first."
    run(env, ["go to shelf 2"])
    assert env.step("examine shelf 2")[0] == "You examine the shelf 2. On it: nothing."
    assert env.step("examine desk 1")[4]["action_valid"] is False
    _, _, _, _, info = env.step("go to desk 1")
    assert {"examine desk 1", "examine desklamp 1", "examine cd 2"} <= set(info["admissible_actions"])
    assert env.step("examine desk 1")[0] == "You examine the desk 1. On it: desklamp 1, cd 2."


def test_any_receptacle_of_the_target_type_wins():
    for shelf in ("shelf 1", "shelf 2"):
        env = tiny("pick_and_place", "apple", "shelf")
        results = run(env, ["go to fridge 1", "open fridge 1", "take apple 1 from fridge 1", f"go to {shelf}",
                            f"put apple 1 in {shelf}"])
        assert results[-1][1:4] == (1.0, True, False) and results[-1][4]["subgoals_done"] == 2
    env = tiny("pick_heat_then_place", "mug", "shelf")  # the state still matters: a cold mug on shelf 2 is no win
    results = run(env, ["go to countertop 1", "take mug 1 from countertop 1", "go to shelf 2", "put mug 1 in shelf 2"])
    assert not results[-1][4]["won"]
    env = tiny("pick_two_obj_and_place", "cd", "shelf")  # both in ONE shelf, as ALFWorld's goal asks
    results = run(env, ["go to desk 1", "take cd 2 from desk 1", "go to shelf 2", "put cd 2 in shelf 2"])
    assert not results[-1][4]["won"] and results[-1][4]["subgoals_done"] == 3
    assert run(env, ["take cd 2 from shelf 2", "go to shelf 1", "put cd 2 in shelf 1"])[-1][1:4] == (1.0, True, False)


def test_expert_puts_into_the_nearest_target_instance():
    env = tiny("pick_and_place", "apple", "shelf")
    run(env, ["go to fridge 1", "open fridge 1", "take apple 1 from fridge 1"])
    assert env.expert_action() == "go to shelf 1"  # neither is nearer: the first by name
    env.step("go to shelf 2")
    assert env.expert_action() == "put apple 1 in shelf 2"  # already at one: put it here
    env = tiny("pick_two_obj_and_place", "cd", "shelf")  # cd 3 on shelf 1: the second cd joins it, not shelf 2
    run(env, ["go to desk 1", "take cd 2 from desk 1", "go to shelf 2"])
    assert env.expert_action() == "go to shelf 1"


def test_generated_tasks_name_a_type_and_start_unsolved_in_every_instance():
    many = 0
    for seed in range(160):
        env = HouseholdText(rooms=1 + seed % 4, task_type=hw.TASK_TYPES[seed % 6])
        _, info = env.reset(seed=seed, options={"split": ("train", "heldout")[seed % 2]})
        task, world = env.world.task, env.world
        assert not any(ch.isdigit() for ch in env.task_description()), env.task_description()
        assert info["subgoals_done"] == 0 and not info["won"]
        if task.task_type == "look_at_obj_in_light":
            continue
        instances = [r for r in world.receptacles if hw.rtype(r) == task.target_type]
        many += len(instances) > 1
        assert instances and not {world.initial[o] for o in world.initial if hw.rtype(o) == task.obj_type} & set(
            instances)
        for recep in instances:  # any instance takes the win
            state = hw.initial_state(world)
            for obj in [o for o in world.initial if hw.rtype(o) == task.obj_type][:task.count]:
                state.where[obj] = recep
                if task.process:
                    state.states[task.process].add(obj)
            assert hw.is_won(world, state), (seed, recep)
    assert many > 10  # several homes have more than one receptacle of the target type


def test_one_room_is_alfworlds_scene_shape():
    for seed in range(60):
        env = HouseholdText(rooms=1, task_type=hw.TASK_TYPES[seed % 6], max_steps=40)
        obs, info = env.reset(seed=seed, options={"split": ("train", "heldout")[seed % 2]})
        room = info["room"]
        assert env.world.rooms == (room,) and set(env.world.recep_room.values()) == {room}
        assert "Other rooms" not in obs
        rng = random.Random(seed)
        for _ in range(20):
            goes = {a[len("go to "):] for a in info["admissible_actions"] if a.startswith("go to ")}
            assert goes == set(env.world.receptacles) - {env.state.loc}  # every receptacle, one step away
            _, _, terminated, truncated, info = env.step(rng.choice(info["admissible_actions"]))
            assert info["room"] == room
            if terminated or truncated:
                break
    assert HouseholdText().reset(seed=0, options={"rooms": 1})[1]["room"] in hw.ROOM_TYPES


def test_pick_two_counts_distinct_objects_of_the_type_in_the_target():
    env = tiny("pick_two_obj_and_place", "cd", "desk")
    _, info = env.reset_to_world(env.world)
    assert info["subgoals_done"] == 2  # cd 2 starts on the target desk: it is the first of the two
    results = run(env, ["go to shelf 1", "take book 1 from shelf 1", "go to desk 1", "put book 1 in desk 1",
                        "go to shelf 1", "take cd 3 from shelf 1", "go to desk 1", "put cd 3 in desk 1"])
    assert [r[4]["subgoals_done"] for r in results] == [2, 2, 2, 2, 2, 3, 3, 4]  # a book is no cd
    assert [r[1] for r in results] == [0.0] * 7 + [1.0] and results[-1][2] and results[-1][4]["won"]
    env = tiny("pick_two_obj_and_place", "cd", "shelf")  # cd 3 already on the shelf: one more needed
    results = run(env, ["go to desk 1", "take cd 2 from desk 1", "go to shelf 1", "put book 1 in shelf 1"])
    assert results[-1][4]["action_valid"] is False
    assert env.step("put cd 2 in shelf 1")[1:4] == (1.0, True, False)


def test_pick_two_subgoals_step_through_both_objects_and_never_decrease():
    env = tiny("pick_two_obj_and_place", "cd", "countertop")
    results = run(env, ["go to desk 1", "take cd 2 from desk 1", "go to countertop 1", "put cd 2 in countertop 1",
                        "take cd 2 from countertop 1", "put cd 2 in countertop 1", "go to shelf 1",
                        "take cd 3 from shelf 1", "go to countertop 1", "put cd 3 in countertop 1"])
    assert [r[4]["subgoals_done"] for r in results] == [0, 1, 1, 2, 2, 2, 2, 3, 3, 4]
    assert [r[4]["won"] for r in results] == [False] * 9 + [True]


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_subgoals_done_never_decreases_under_random_play(split):
    for seed in range(60):
        env = HouseholdText(max_steps=60)
        _, info = env.reset(seed=seed, options={"split": split})
        rng = random.Random(seed)
        seen = [info["subgoals_done"]]
        done = False
        while not done:
            _, _, terminated, truncated, info = env.step(rng.choice(info["admissible_actions"]))
            seen.append(info["subgoals_done"])
            assert info["subgoals_total"] == len(info["subgoals"])
            done = terminated or truncated
        assert seen == sorted(seen) and seen[-1] <= info["subgoals_total"]
        assert (seen[-1] == info["subgoals_total"]) == info["won"]


def test_unseen_combos_are_a_fifth_and_cover_every_task_type():
    every = {c for t in hw.TASK_TYPES for c in hw.task_combos(t)}
    assert hw.UNSEEN_COMBOS < every and 0.15 < len(hw.UNSEEN_COMBOS) / len(every) < 0.25
    for task_type in hw.TASK_TYPES:
        splits = {hw.combo_split(*c) for c in hw.task_combos(task_type)}
        assert splits == {"train", "heldout"}, task_type


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_splits_use_only_their_own_combos_and_layouts(split):
    for rooms in (1, 2, 4):
        for scenario in make_scenarios("household", split, 60, seed=rooms, options={"rooms": rooms}):
            env = make_env("household")
            env.reset(seed=scenario.seed, options=dict(scenario.options))
            task = env.world.task
            assert hw.combo_split(task.obj_type, task.target_type) == split
            assert len(env.world.rooms) == rooms
            if split == "heldout":
                assert set(env.world.templates) == {hw.HELDOUT_TEMPLATE}
            else:
                assert hw.HELDOUT_TEMPLATE not in env.world.templates


def test_bad_options_and_kwargs_raise_value_errors_that_list_valid_values():
    env = HouseholdText()
    with pytest.raises(ValueError, match="valid splits"):
        env.reset(seed=0, options={"split": "test"})
    with pytest.raises(ValueError, match="valid options"):
        env.reset(seed=0, options={"room": 2})
    with pytest.raises(ValueError, match="valid: .*pick_two_obj_and_place"):
        env.reset(seed=0, options={"task_type": "pick_three"})
    with pytest.raises(ValueError, match="rooms must be in 1..4"):
        HouseholdText(rooms=5)
    with pytest.raises(ValueError, match="verbosity"):
        HouseholdText(verbosity="loud")
    with pytest.raises(RuntimeError, match="reset"):
        HouseholdText().step("look")


def test_invalid_actions_change_nothing_but_count_and_pay_the_penalty():
    env = HouseholdText(invalid_penalty=0.25, max_steps=3)
    obs0, info0 = env.reset(seed=4)
    for text in ["@@", "go to nowhere 9", "take apple 1 from fridge 1"]:
        obs, reward, terminated, truncated, info = env.step(text)
        assert (reward, info["action_valid"], info["anchor"]) == (-0.25, False, info0["anchor"])
        assert obs.startswith("Nothing happens.")
    assert truncated and not terminated and info["steps"] == 3 and not info["admissible_actions"]
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("look")


def test_truncation_at_max_steps_from_the_reset_option():
    env = HouseholdText()
    _, info = env.reset(seed=1, options={"max_steps": 4})
    flags = [env.step("look")[2:4] for _ in range(4)]
    assert flags == [(False, False)] * 3 + [(False, True)]


def test_anchor_is_the_same_for_the_same_state():
    env = tiny("pick_and_place", "apple", "shelf")
    a = [r[4]["anchor"] for r in run(env, ["go to fridge 1", "go to desk 1", "go to fridge 1", "open fridge 1",
                                           "close fridge 1", "look", "open fridge 1", "take apple 1 from fridge 1",
                                           "put apple 1 in fridge 1"])]
    assert a[0] == a[2] == a[4] == a[5] and a[3] == a[6] == a[8]
    assert len({a[0], a[1], a[3], a[7]}) == 4
    assert a[0].startswith("tiny0000|fridge 1|-|") and a[7].startswith("tiny0000|fridge 1|apple 1|")
    other = tiny("pick_and_place", "apple", "shelf")
    assert other.step("go to fridge 1")[4]["anchor"] == a[0]  # same state in a fresh env, same anchor


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_expert_wins_every_task_type_and_room_count(split):
    for task_type in hw.TASK_TYPES:
        for rooms in (1, 2, 3, 4):
            for seed in range(25):
                env = HouseholdText(rooms=rooms, task_type=task_type, distractors=seed % 6)
                _, info = env.reset(seed=seed, options={"split": split})
                info = play_expert(env, info)
                assert info["won"] and info["steps"] <= 12, (task_type, rooms, seed)
                assert info["subgoals_done"] == info["subgoals_total"]


def test_expert_trajectories_of_scenario_sets():
    for split in ("train", "heldout"):
        for scenario in make_scenarios("household", split, 50, seed=0):
            steps = expert_trajectory(scenario)  # raises unless won
            assert 3 <= len(steps) <= 12


def test_expert_recovers_after_any_history():
    for seed in range(80):
        env = HouseholdText(max_steps=60, rooms=1 + seed % 4)
        _, info = env.reset(seed=seed, options={"split": ("train", "heldout")[seed % 2]})
        rng = random.Random(seed)
        for _ in range(rng.randrange(25)):
            _, _, terminated, _, info = env.step(rng.choice(info["admissible_actions"]))
            if terminated:
                break
        if not terminated:
            before = info["steps"]
            info = play_expert(env, info)
            assert info["won"] and info["steps"] - before <= 14, seed


def test_admissible_actions_are_exactly_the_valid_ones():
    env = tiny("pick_and_place", "apple", "shelf")
    run(env, ["go to shelf 1"])
    assert admissible_actions(env.world, env.state) == sorted(
        ["inventory", "look", "examine book 1", "examine cd 3", "examine shelf 1", "take book 1 from shelf 1",
         "take cd 3 from shelf 1"]
        + [f"go to {r}" for r in RECEP_ROOM if r != "shelf 1"])
    _, _, _, _, info = env.step("take book 1 from shelf 1")
    assert "examine book 1" in info["admissible_actions"] and "put book 1 in shelf 1" in info["admissible_actions"]
    assert env.step("use desklamp 1")[4]["action_valid"] is False  # the lamp is on desk 1, not here


def test_full_verbosity_adds_the_task_every_room_and_the_inventory():
    short, full = HouseholdText(rooms=3), HouseholdText(rooms=3, verbosity="full")
    obs_short, info_short = short.reset(seed=2)
    obs_full, info_full = full.reset(seed=2)
    lines = obs_full.split("\n")
    assert info_short["anchor"] == info_full["anchor"] and len(lines) == 4
    assert lines[0] == full.task_description() and lines[1] == obs_short.split(" Other rooms:")[0]
    others = [room for room in full.world.rooms if room != info_full["room"]]
    assert [line.split(":")[0] for line in lines[2:]] == [f"In the {room}" for room in others]
    assert full.step("inventory")[0] == "You are not carrying anything. You carry: nothing."


# ------------------------------------------------------------------------ ALFWorld's PDDL rules, in our words
# Each action of ALFWorld's domain (alfred.pddl; the TextWorld-ALFWorld engine plays the same rules) as a predicate
# over household's state: world w, state s, then the action's arguments. Notes say where household deliberately
# differs from the PDDL text.
SLICEABLE: frozenset[str] = frozenset()  # SliceObject needs a sliceable object; household's catalog has none


def _reachable(s, recep: str) -> bool:
    """``(or (not (openable ?r)) (opened ?r))``."""
    return hw.rtype(recep) not in hw.OPENABLE or recep in s.opened


def _examinable(w, s, thing: str) -> bool:
    if thing in w.receptacles:  # examineReceptacle: the agent is at it (open or closed)
        return s.loc == thing
    if thing in w.lamps:  # examineObject for a lamp: it stands on the receptacle the agent is at
        return s.loc == w.lamps[thing]
    return thing in s.where and (s.held == thing or (s.where[thing] == s.loc and _reachable(s, s.loc)))


PDDL_PRECONDITIONS = {
    "look": ("look: always (the start, the middle of the room, is a location too)", lambda w, s: True),
    "inventory": ("inventory: always", lambda w, s: True),
    "go to": ("GotoLocation R: R is a receptacle of the scene; household leaves out the one the agent is at",
              lambda w, s, r: r in w.receptacles and s.loc != r),
    "open": ("OpenObject R: agent at R, R openable, R closed (the PDDL's 'nothing else open' is a planner device "
             "ALFWorld's text game does not keep)",
             lambda w, s, r: s.loc == r and hw.rtype(r) in hw.OPENABLE and r not in s.opened),
    "close": ("CloseObject R: agent at R, R openable, R open",
              lambda w, s, r: s.loc == r and hw.rtype(r) in hw.OPENABLE and r in s.opened),
    "take": ("PickupObject O from R: agent at R, O in R, R open if openable, hand empty",
             lambda w, s, o, r: s.loc == r and s.where.get(o) == r and _reachable(s, r) and s.held is None),
    "put": ("PutObject O in R: agent holds O, agent at R, R open if openable (canContain is off in the PDDL too)",
            lambda w, s, o, r: s.held == o and s.loc == r and _reachable(s, r)),
    "clean": ("CleanObject O with R: O cleanable, R a sinkbasin, agent at R, agent holds O",
              lambda w, s, o, r: hw.supports(hw.rtype(o), "clean") and hw.rtype(r) == "sinkbasin" and s.loc == r
              and s.held == o),
    "heat": ("HeatObject O with R: O heatable, R a microwave, agent at R, agent holds O",
             lambda w, s, o, r: hw.supports(hw.rtype(o), "heat") and hw.rtype(r) == "microwave" and s.loc == r
             and s.held == o),
    "cool": ("CoolObject O with R: O coolable, R a fridge, agent at R, agent holds O",
             lambda w, s, o, r: hw.supports(hw.rtype(o), "cool") and hw.rtype(r) == "fridge" and s.loc == r
             and s.held == o),
    "use": ("ToggleObject L (useLamp): L toggleable (a desk lamp), agent at the receptacle L stands on",
            lambda w, s, lamp: lamp in w.lamps and s.loc == w.lamps[lamp]),
    "slice": ("SliceObject O with K: O sliceable, K a knife, agent holds K, O where the agent is",
              lambda w, s, o, k: hw.rtype(o) in SLICEABLE and hw.rtype(k) == "knife" and s.held == k
              and s.where.get(o) == s.loc),
    "examine": ("examineReceptacle R: agent at R; examineObject O: agent holds O, or O in an open receptacle the "
                "agent is at", _examinable),
}


def pddl_effect(w, s, verb: str, args: tuple):
    """The state after an action whose preconditions hold, from the PDDL effects (a copy; ``s`` is untouched)."""
    s = copy.deepcopy(s)
    if verb == "go to":
        s.loc, s.room = args[0], w.recep_room[args[0]]
    elif verb in ("open", "close"):
        (s.opened.add if verb == "open" else s.opened.discard)(args[0])
    elif verb == "take":
        s.held, s.where[args[0]] = args[0], None
    elif verb == "put":
        s.held, s.where[args[0]] = None, args[1]
    elif verb in ("clean", "heat", "cool"):
        s.states[verb].add(args[0])
        if verb != "clean":  # isHot and isCool undo each other
            s.states["cool" if verb == "heat" else "heat"].discard(args[0])
    elif verb == "use":
        s.lamps_on ^= {args[0]}  # (when (isOn ?o) (not (isOn ?o))) (when (not (isOn ?o)) (isOn ?o))
    return s


def pddl_goal(w, s) -> bool:
    """ALFWorld's goals: an object of the type, in the state asked for, held at a lit lamp (look) or ``count`` of
    them in ONE receptacle of the target type."""
    task = w.task
    if task.task_type == "look_at_obj_in_light":
        return (s.held is not None and hw.rtype(s.held) == task.obj_type
                and any(host == s.loc and lamp in s.lamps_on for lamp, host in w.lamps.items()))
    good = [r for o, r in s.where.items() if hw.rtype(o) == task.obj_type
            and (task.process is None or o in s.states[task.process])]
    return any(good.count(r) >= task.count for r in w.receptacles if hw.rtype(r) == task.target_type)


def action_text(verb: str, args: tuple) -> str:
    forms = {"take": "take {} from {}", "put": "put {} in {}", "slice": "slice {} with {}",
             **{p: p + " {} with {}" for p in ("clean", "heat", "cool")}}
    return forms[verb].format(*args) if verb in forms else " ".join([verb, *args])


def candidate_actions(w, s, rng: random.Random) -> list[tuple[str, tuple]]:
    """Every verb on every receptacle and lamp; object verbs at the agent's place, the object's and a random one."""
    found = [("look", ()), ("inventory", ())]
    for recep in w.receptacles:
        found += [(verb, (recep,)) for verb in ("go to", "open", "close", "examine")]
    objects = sorted(s.where)
    for obj in objects:
        for recep in sorted({s.loc, s.where[obj], rng.choice(w.receptacles)} - {None}):
            found += [(verb, (obj, recep)) for verb in ("take", "put", "clean", "heat", "cool")]
        found += [("examine", (obj,)), ("slice", (obj, rng.choice(objects)))]
    return found + [(verb, (lamp,)) for lamp in w.lamps for verb in ("use", "examine")]


@pytest.mark.parametrize("rooms", [1, 0], ids=["one_room", "multi_room"])
def test_household_rules_are_alfworlds_pddl_preconditions_and_effects(rooms):
    """In every state of mixed walks (expert, random admissible and random refused moves; 160 seeds per room mode,
    ~7,000 states each), an action is admissible exactly when PDDL_PRECONDITIONS holds; a step changes the state as
    pddl_effect says (nothing, when refused), and wins exactly when pddl_goal holds."""
    checked, done_verbs, refused = 0, set(), 0
    for seed in range(160):
        env = HouseholdText(rooms=rooms or 2 + seed % 3, distractors=seed % 6, max_steps=50,
                            task_type=hw.TASK_TYPES[seed % 6])
        _, info = env.reset(seed=seed, options={"split": ("train", "heldout")[seed % 2]})
        rng, world, done = random.Random(seed), env.world, False
        while not done:
            state, admissible = copy.deepcopy(env.state), set(info["admissible_actions"])
            candidates = candidate_actions(world, state, rng)
            holds = {action_text(v, a): PDDL_PRECONDITIONS[v][1](world, state, *a) for v, a in candidates}
            assert admissible == {text for text, ok in holds.items() if ok}, (seed, state)
            checked += 1
            roll, expert = rng.random(), env.expert_action()
            if roll < 0.15 and expert is not None:  # some expert moves, so heat/cool/clean and wins happen too
                verb, args = next((v, a) for v, a in candidates if action_text(v, a) == expert)
            elif roll < 0.65:
                verb, args = rng.choice([(v, a) for v, a in candidates if holds[action_text(v, a)]])
            else:  # mostly refused: the state must not change
                verb, args = rng.choice(candidates)
            text = action_text(verb, args)
            _, reward, terminated, truncated, info = env.step(text)
            assert info["action_valid"] == holds[text]
            done_verbs, refused = done_verbs | ({verb} if holds[text] else set()), refused + (not holds[text])
            assert env.state == (pddl_effect(world, state, verb, args) if holds[text] else state), (seed, text)
            assert info["won"] == terminated == pddl_goal(world, env.state) and reward == float(info["won"])
            done = terminated or truncated
    assert checked > 5000 and refused > 1000, (checked, refused)  # ~7,000 states per room mode
    assert done_verbs == set(PDDL_PRECONDITIONS) - {"slice"}, done_verbs  # every rule carried out, not only checked
