"""Per-env scenario keys: what each env counts as "the same scenario" (envs/base.py, "Scenario identity")."""
from __future__ import annotations

import dataclasses

import envs  # noqa: F401  (importing the package registers the envs)
from envs.base import Scenario, make_env, observation_key, scenario_content_key
from envs.rps import MOVES, Opponent
from envs.scenarios import make_scenarios
from envs.terminal import top_listing
from envs.textworld_cooking import TextWorldCooking


def same_first_observation(name: str, n: int) -> list[Scenario]:
    """Two train scenarios of ``name`` whose first observations (and task texts) are equal."""
    env = make_env(name)
    seen: dict[str, Scenario] = {}
    for scenario in make_scenarios(name, "train", n, seed=0):
        obs, _ = env.reset(seed=scenario.seed, options=dict(scenario.options))
        key = observation_key(env, obs)
        if key in seen:
            return [seen[key], scenario]
        seen[key] = scenario
    raise AssertionError(f"no two of {n} {name} scenarios share a first observation")


def test_frozenlake_key_is_the_map_and_ignores_slips():
    (scenario,) = make_scenarios("frozenlake", "train", 1, seed=0)
    plain, slippery = make_env("frozenlake"), make_env("frozenlake", is_slippery=True)
    obs, _ = plain.reset(seed=scenario.seed)
    assert scenario_content_key(plain, scenario) == observation_key(plain, obs)
    assert scenario_content_key(slippery, scenario) == scenario_content_key(plain, scenario)


def test_tree_search_key_sees_the_hidden_goal_and_every_hint():
    first, second = same_first_observation("tree_search", 60)
    env = make_env("tree_search")
    keys = [scenario_content_key(env, s) for s in (first, second)]
    assert keys[0] != keys[1]
    head, hints = keys[1].rsplit(":", 1)
    assert head == f"3:3:18:{'-'.join(map(str, env._goal))}"  # branching, depth, step limit, goal
    assert [len(level) for level in hints.split("/")] == [1, 3, 9]  # one hint per inner node
    env.reset(seed=second.seed)
    assert env.scenario_key() == keys[1]


def test_rps_key_is_the_behaviour_not_the_strategy_label():
    env = make_env("rps")
    env.reset(seed=0, options={"split": "heldout"})

    def key(opponent: Opponent) -> str:
        env.opponent = opponent
        return env.scenario_key()

    # held-out cycle -1 from rock plays r, s, p, r, ...: the train pattern (rock, scissors, paper) does the same
    cycle = key(Opponent("cycle", opening=0, step=-1))
    assert cycle == key(Opponent("pattern", opening=2, sequence=(0, 2, 1))) == "9:fixed:rsprsprsp"
    assert key(Opponent("copy", opening=0, lag=1)) != key(Opponent("copy", opening=0, lag=2))
    assert key(Opponent("copy", opening=1, lag=9)) == "9:fixed:" + MOVES[1][0] * 9  # never sees a move of yours
    assert key(Opponent("counter_frequent", opening=0, window=8)) == key(Opponent("counter_frequent", opening=0))


def test_holdem_key_is_the_whole_deal_hidden_cards_included():
    first, second = same_first_observation("holdem", 400)
    env = make_env("holdem")
    assert scenario_content_key(env, first) != scenario_content_key(env, second)

    caller = make_env("holdem", opponent="caller")  # never folds: the hand reaches a showdown
    scenario = make_scenarios("holdem", "train", 1, seed=0)[0]
    opponent, hands, position, hole, opp, flop, turn, river = scenario_content_key(caller, scenario).split("|")
    assert (opponent, hands) == ("caller", "1")
    obs, info = caller.reset(seed=scenario.seed)
    done = False
    while not done:
        action = "check" if "check" in info["admissible_actions"] else "call"
        obs, _, terminated, truncated, info = caller.step(action)
        done = terminated or truncated
    pair = lambda cards: f"{cards[:2]} {cards[2:]}"  # noqa: E731
    assert f"opp had {pair(opp)}" in obs
    assert f"cards: {pair(hole)} | board: {' '.join([flop[:2], flop[2:4], flop[4:], turn, river])}" in obs


def test_household_key_sees_objects_the_first_observation_hides():
    env = make_env("household")
    env.reset(seed=3)
    world = env.world
    obj, recep = sorted(world.initial.items())[0]
    other = next(r for r in world.receptacles if r != recep)
    moved = dataclasses.replace(world, initial={**world.initial, obj: other})
    first_obs, _ = env.reset_to_world(world)
    key = env.scenario_key()
    moved_obs, _ = env.reset_to_world(moved)
    assert moved_obs == first_obs and env.scenario_key() != key


def test_terminal_key_sees_file_contents():
    env = make_env("terminal")
    try:
        obs, _ = env.reset(seed=1)
        key = env.scenario_key()
        path = sorted(env._task.files)[0]
        env._task = dataclasses.replace(env._task, files={**env._task.files, path: "changed\n"})
        assert top_listing(env._task.files) == obs  # the first observation only lists the names
        assert env.scenario_key() != key
    finally:
        env.close()


def test_search_qa_key_is_the_question_and_its_answer():
    env = make_env("search_qa")
    env.reset(seed=0)
    question = env._question
    assert env.scenario_key() == f"{question['question']}|{question['answer']}|tools True"


def test_textworld_key_needs_no_game(tmp_path):
    env = TextWorldCooking(games_dir=str(tmp_path))
    train = Scenario(env="textworld_cooking", seed=5, split="train", options=(("split", "train"),))
    heldout = dataclasses.replace(train, split="heldout", options=(("split", "heldout"),))
    assert scenario_content_key(env, train) == "r1t1g1:train:5:max_steps None"
    assert scenario_content_key(env, heldout) == "r1t1g1:valid:5:max_steps None"  # TextWorld's own valid split
    assert not any(tmp_path.iterdir())  # nothing generated
    assert len({scenario_content_key(env, s) for s in make_scenarios("textworld_cooking", "heldout", 50, seed=0)}) == 50
