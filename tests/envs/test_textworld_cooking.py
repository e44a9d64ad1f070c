"""TextWorldCooking: game files (paths, determinism, atomic regeneration), splits, the expert, actions, rewards,
anchors, truncation and many envs at once. Games are generated once per session into a temporary folder."""
from __future__ import annotations

import json
import logging
import random

import pytest
from textworld.challenges.tw_cooking.cooking import FOODS_SPLITS
from textworld.logic import Proposition, Variable

from agents.parser import parse_action
from envs import ENVS, make_env, make_scenarios
from envs.scenarios import expert_trajectory
from envs.textworld_cooking import INVALID_FEEDBACK, TextWorldCooking, shorten_feedback, summarize_room
from envs.textworld_games import CookingSettings, game_file_problem, game_path, generate_game, generate_games

DEFAULT = CookingSettings()
HARD = dict(recipe=2, take=2, go=6, open=True, cook=True, cut=True)
BBQ = dict(go=9, cook=True)  # 9+ rooms bring the backyard and its BBQ: grilled recipes ("cook x with BBQ")
BBQ_HARD = dict(recipe=2, take=2, go=9, open=True, cook=True, cut=True)


@pytest.fixture(scope="session")
def games_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tw_cooking_games")


@pytest.fixture
def make(games_dir):
    def factory(**kwargs) -> TextWorldCooking:
        return TextWorldCooking(games_dir=str(games_dir), **kwargs)
    return factory


def metadata(path) -> dict:
    return json.loads(path.with_suffix(".json").read_text())["metadata"]


def play_expert(env: TextWorldCooking, seed: int, split: str) -> tuple[list[float], list[dict]]:
    _, info = env.reset(seed=seed, options={"split": split})
    rewards, infos, done = [], [info], False
    while not done:
        action = env.expert_action()
        assert action is not None, f"expert stuck at step {info['steps']}"
        _, reward, terminated, truncated, info = env.step(action)
        rewards.append(reward)
        infos.append(info)
        done = terminated or truncated
    return rewards, infos


def test_registered_split_aware_and_constructible_without_kwargs():
    assert ENVS["textworld_cooking"] is TextWorldCooking and TextWorldCooking.split_aware is True
    env = make_env("textworld_cooking")
    assert env.settings == DEFAULT and env.max_steps is None and env.verbosity == "short"


def test_game_path_is_pure_and_maps_splits(tmp_path):
    assert game_path(tmp_path, 5, "train", DEFAULT) == tmp_path / "r1t1g1" / "train" / "s5.z8"
    assert game_path(tmp_path, 5, "heldout", DEFAULT) == tmp_path / "r1t1g1" / "valid" / "s5.z8"
    test_split = CookingSettings(heldout_split="test")
    assert game_path(tmp_path, 5, "heldout", test_split) == tmp_path / "r1t1g1" / "test" / "s5.z8"
    assert CookingSettings(**HARD).tag == "r2t2g6-open-cook-cut"
    assert not list(tmp_path.iterdir())  # nothing written
    with pytest.raises(ValueError, match="valid splits"):
        game_path(tmp_path, 5, "dev", DEFAULT)
    with pytest.raises(ValueError, match="seed must be in"):
        game_path(tmp_path, -1, "train", DEFAULT)


@pytest.mark.parametrize("kwargs, message", [
    (dict(recipe=6), "recipe must be in 1..5"), (dict(take=2), "take must be in 0..recipe"),
    (dict(go=5), r"go must be one of \[1, 6, 9, 12\]"), (dict(heldout_split="train"), "heldout_split must be"),
    (dict(verbosity="long"), "verbosity must be 'short' or 'full'"), (dict(max_steps=0), "max_steps must be"),
])
def test_bad_kwargs_raise_value_error_naming_valid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TextWorldCooking(**kwargs)


def test_bad_reset_options_raise_before_generating(make, games_dir):
    env = make()
    with pytest.raises(ValueError, match=r"valid options: \['split'\]"):
        env.reset(seed=0, options={"size": 3})
    with pytest.raises(ValueError, match=r"valid splits: \['train', 'heldout'\]"):
        env.reset(seed=0, options={"split": "valid"})


def test_generation_is_deterministic_and_atomic(tmp_path):
    first = generate_game(3, "train", DEFAULT, tmp_path / "a")
    second = generate_game(3, "train", DEFAULT, tmp_path / "b")
    assert first.with_suffix(".json").read_bytes() == second.with_suffix(".json").read_bytes()
    mask = lambda data: data[:0x12] + data[0x18:0x1C] + data[0x1E:]  # noqa: E731  (serial = compile date, checksum)
    assert mask(first.read_bytes()) == mask(second.read_bytes())
    assert sorted(p.name for p in first.parent.iterdir()) == ["s3.json", "s3.z8"]  # no temp leftovers
    mtime = first.stat().st_mtime_ns
    assert generate_game(3, "train", DEFAULT, tmp_path / "a") == first and first.stat().st_mtime_ns == mtime


def test_split_mapping_uses_textworlds_food_splits(games_dir):
    train = metadata(generate_game(0, "train", DEFAULT, games_dir))
    heldout = metadata(generate_game(0, "heldout", DEFAULT, games_dir))
    assert train["settings"]["split"] == "train" and "-train-" in train["uuid"]
    assert heldout["settings"]["split"] == "valid" and "-valid-" in heldout["uuid"]
    assert all(name in FOODS_SPLITS["train"] for name, _, _ in train["ingredients"])


def test_expert_follows_walkthrough_and_rewards_sum_to_one(make, games_dir):
    env = make()
    for seed, split in [(0, "train"), (1, "train"), (0, "heldout")]:
        rewards, infos = play_expert(env, seed, split)
        walkthrough = metadata(game_path(games_dir, seed, split, DEFAULT))["walkthrough"]
        assert len(rewards) == len(walkthrough) and infos[-1]["won"] and not infos[-1]["lost"]
        total = infos[-1]["subgoals_total"]
        assert total == 3  # take the ingredient, prepare the meal, eat it
        assert sum(rewards) == pytest.approx(1.0)
        assert sorted(r for r in rewards if r) == pytest.approx([1 / total] * total)
        done = [info["subgoals_done"] for info in infos]
        assert done == sorted(done) and done[0] == 0 and done[-1] == total
        assert infos[-1]["admissible_actions"] == [] and env.expert_action() is None


def test_expert_recovers_after_random_detours(make):
    env = make()
    rng = random.Random(0)
    wins = 0
    for trial in range(4):
        _, info = env.reset(seed=1, options={"split": "train"})
        for _ in range(rng.randint(2, 8)):  # detour: random admissible actions, never eating
            safe = [a for a in info["admissible_actions"] if not a.startswith(("eat", "prepare"))]
            _, _, terminated, truncated, info = env.step(rng.choice(safe))
        while not (terminated or truncated):
            _, _, terminated, truncated, info = env.step(env.expert_action())
        wins += info["won"]
    assert wins == 4


def test_admissible_actions_and_invalid_actions(make):
    env = make(invalid_penalty=0.25)
    _, info = env.reset(seed=0)
    actions = info["admissible_actions"]
    assert actions == sorted(actions) and {"examine cookbook", "inventory", "look"} <= set(actions)
    anchor = info["anchor"]
    for bad in ["fly to the moon", "", None, "go north"]:  # "go north": no exit in a 1-room kitchen
        obs, reward, terminated, truncated, info = env.step(bad)
        assert (obs, reward, terminated, truncated) == (INVALID_FEEDBACK, -0.25, False, False)
        assert info["action_valid"] is False and info["anchor"] == anchor
    assert info["steps"] == 4
    obs, reward, _, _, info = env.step("  Examine   COOKBOOK ")
    assert info["action_valid"] is True and reward == 0.0 and obs.startswith("Recipe. Ingredients:")


@pytest.mark.parametrize("kwargs, seed, split", [(BBQ, 7, "train"), (BBQ, 0, "heldout"), (BBQ_HARD, 0, "train")],
                         ids=["bbq-train", "bbq-heldout", "bbq-hard"])
def test_expert_wins_games_that_need_the_bbq(make, games_dir, kwargs, seed, split):
    # TextWorld's commands are case-sensitive ("cook pork chop with BBQ"): a lowercased one used to be invalid
    env = make(**kwargs)
    rewards, infos = play_expert(env, seed, split)
    walkthrough = metadata(game_path(games_dir, seed, split, env.settings))["walkthrough"]
    assert any(command.endswith(" with BBQ") for command in walkthrough)  # the recipe grills
    assert all(info["action_valid"] for info in infos) and infos[-1]["won"]
    assert sum(rewards) == pytest.approx(1.0)


def test_commands_match_case_insensitively_and_are_sent_in_textworlds_spelling(make, monkeypatch):
    env = make(**BBQ)
    _, info = env.reset(seed=7)  # walkthrough: ..., take chicken leg from fridge, go west, cook chicken leg with BBQ
    while "cook chicken leg with BBQ" not in info["admissible_actions"]:
        _, _, _, _, info = env.step(env.expert_action())
    assert env.expert_action() == "cook chicken leg with BBQ"
    assert parse_action("Cook chicken leg with bbq.", info["admissible_actions"]) == ("cook chicken leg with BBQ", True)
    sent: list[str] = []
    step = env._tw.step
    monkeypatch.setattr(env._tw, "step", lambda command: sent.append(command) or step(command))
    for bad in ["cook chicken leg with grill", "cook chicken leg with bbq please", "bbq"]:
        assert env.step(bad)[4]["action_valid"] is False
    assert sent == []  # invalid commands never reach the game
    obs, _, _, _, info = env.step("examine  bbq")
    assert info["action_valid"] is True and sent == ["examine BBQ"] and "grilling" in obs
    obs, reward, _, _, info = env.step("COOK chicken leg WITH bbq")
    assert info["action_valid"] is True and sent[-1] == "cook chicken leg with BBQ"
    assert reward > 0 and "grilled" in obs


def test_lost_terminates_without_win(make, games_dir):
    env = make()
    env.reset(seed=0)
    food = metadata(game_path(games_dir, 0, "train", DEFAULT))["ingredients"][0][0]
    env.step("inventory")
    env.step("examine cookbook")
    take = env.expert_action()
    assert take.startswith(f"take {food}")
    env.step(take)
    obs, reward, terminated, truncated, info = env.step(f"eat {food}")
    assert terminated and not truncated and info["lost"] and not info["won"] and "You lost" in obs
    assert env.expert_action() is None


def test_truncation_counts_invalid_actions(make):
    env = make(max_steps=3)
    env.reset(seed=0)
    assert env.step("look")[3] is False
    assert env.step("@@")[3] is False
    _, _, terminated, truncated, info = env.step("inventory")
    assert truncated and not terminated and info["steps"] == 3
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("look")
    assert make().reset(seed=0)[1]["max_steps"] == 50  # default: max(50, 3 x walkthrough of 5)


def test_anchor_is_canonical_state(make):
    env = make()
    _, info = env.reset(seed=0)
    start = info["anchor"]
    assert env.step("look")[4]["anchor"] == start  # no state change, same anchor
    closed = env.step("close fridge")[4]["anchor"]
    assert closed != start
    assert env.step("open fridge")[4]["anchor"] == start  # back to the same state
    assert make().reset(seed=0)[1]["anchor"] == start
    assert make().reset(seed=1)[1]["anchor"].split(":")[0] != start.split(":")[0]


def test_short_observation_keeps_what_full_text_shows(make):
    short_env, full_env = make(), make(verbosity="full")
    short, _ = short_env.reset(seed=1)
    full, _ = full_env.reset(seed=1)
    assert "$$" not in full and full.startswith("You are hungry!") and "-= Kitchen =-" in full
    assert short.startswith("Kitchen: ") and "$$" not in short and "\n" not in short and len(short) < len(full) / 2
    things = [part.split(":")[-1].split("(")[0] for part in short.split(". Exits")[0].split(";")]
    names = [name.strip() for thing in things for name in thing.split(",") if name.strip()]
    assert names and all(name.split()[-1] in full for name in names)
    look_short = short_env.step("look")[0]
    assert look_short == short.split(" You carry:")[0]


def fact(name: str, *args: str) -> Proposition:
    return Proposition(name, [Variable(*arg.split(":")) if ":" in arg else Variable(arg, arg) for arg in args])


KITCHEN_FACTS = [
    fact("at", "P", "kitchen:r"), fact("at", "fridge:c", "kitchen:r"), fact("closed", "fridge:c"),
    fact("in", "carrot:f", "fridge:c"), fact("at", "table:s", "kitchen:r"), fact("on", "knife:o", "table:s"),
    fact("on", "red apple:f", "table:s"), fact("sliced", "red apple:f"), fact("fried", "red apple:f"),
    fact("at", "counter:s", "kitchen:r"), fact("at", "cookbook:o", "kitchen:r"),
    fact("north_of", "pantry:r", "kitchen:r"), fact("link", "kitchen:r", "plain door:d", "pantry:r"),
    fact("closed", "plain door:d"), fact("west_of", "corridor:r", "kitchen:r"), fact("east_of", "kitchen:r", "den:r"),
    fact("in", "pork chop:f", "I"), fact("needs_cooking", "pork chop:f"), fact("burned", "carrot:f"),
]


def test_summarize_room_by_hand():
    # the carrot hides in the closed fridge; "east_of(kitchen, den)" is the den's exit, not the kitchen's
    assert summarize_room(KITCHEN_FACTS, with_inventory=True) == (
        "Kitchen: counter (empty); fridge (closed); table: knife, sliced fried red apple; floor: cookbook. "
        "Exits: north (closed plain door), west. You carry: raw pork chop.")
    opened = [f for f in KITCHEN_FACTS if f != fact("closed", "fridge:c")]
    assert "fridge: burned carrot;" in summarize_room(opened)


def test_shorten_feedback_by_hand():
    chrome = "\n\n>" + " " * 40 + "-= Kitchen =-1/5"
    took = "\nYou take the knife.\n\n\n\nYour score has just gone up by one point.\n" + chrome
    assert shorten_feedback(took, KITCHEN_FACTS) == "You take the knife. Your score has just gone up by one point."
    moved = "\n-= Kitchen =-\nYou've entered a kitchen.\n\nYou see a table. Wow!\n" + chrome
    assert shorten_feedback(moved, KITCHEN_FACTS) == summarize_room(KITCHEN_FACTS)
    book = ('You open the copy of "Cooking: A Modern Approach (3rd Ed.)" and start reading:\n\nRecipe #1\n---------\n'
            "Gather all following ingredients and follow the directions to prepare this tasty meal.\n\n"
            "Ingredients:\ncarrot\n  red apple\n\nDirections:\nslice the carrot\n  prepare meal\n" + chrome)
    assert shorten_feedback(book, KITCHEN_FACTS) == (
        "Recipe. Ingredients: carrot, red apple. Directions: slice the carrot, prepare meal.")
    end = ("You eat the meal. Not bad.\n\n" + " " * 50 + "*** The End ***\n\nYou scored 3 out of a possible 3, "
           "in 6 turns.\n\n\nWould you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?" + chrome)
    assert shorten_feedback(end, KITCHEN_FACTS) == (
        "You eat the meal. Not bad. *** The End *** You scored 3 out of a possible 3, in 6 turns.")


def test_corrupt_or_deleted_game_is_regenerated(make, games_dir, caplog):
    path = generate_game(2, "train", DEFAULT, games_dir)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    assert "truncated" in game_file_problem(path)
    with caplog.at_level(logging.WARNING, logger="envs.textworld_cooking"):
        obs, _ = make().reset(seed=2)
    assert "corrupt" in caplog.text and "regenerating" in caplog.text and str(path) in caplog.text
    assert path.read_bytes() == good and game_file_problem(path) is None and obs.startswith("Kitchen")
    path.with_suffix(".json").write_text("{not json")
    assert "unreadable" in game_file_problem(path)
    path.unlink()
    assert game_file_problem(path) == "missing"
    make().reset(seed=2)
    assert game_file_problem(path) is None


def test_many_envs_are_independent_and_closable(make):
    envs = [make() for _ in range(8)]
    for env in envs:
        env.reset(seed=0)
    envs[0].step("close fridge")
    assert envs[1].step("look")[4]["anchor"] != envs[0].step("look")[4]["anchor"]
    for env in envs:
        env.close()
        env.close()  # idempotent
    with pytest.raises(RuntimeError, match="before reset"):
        envs[0].step("look")
    assert envs[0].reset(seed=0)[0].startswith("Kitchen")


@pytest.mark.slow
def test_generate_games_pool_is_idempotent(tmp_path):
    jobs = [(7, "train"), (7, "heldout"), (7, "train")]
    paths = generate_games(jobs, tmp_path, progress=False)
    assert paths[0] == paths[2] and all(game_file_problem(p) is None for p in paths)
    mtimes = [p.stat().st_mtime_ns for p in paths]
    assert generate_games(jobs, tmp_path, progress=False) == paths
    assert [p.stat().st_mtime_ns for p in paths] == mtimes


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "heldout"])
@pytest.mark.parametrize("kwargs", [{}, HARD], ids=["default", "hard"])
def test_expert_wins_scenarios(games_dir, split, kwargs):
    for scenario in make_scenarios("textworld_cooking", split, 5, seed=0):
        steps = expert_trajectory(scenario, games_dir=str(games_dir), **kwargs)  # raises unless won
        assert steps[0][2] == "inventory" and "examine cookbook" in [a for _, _, a in steps]
