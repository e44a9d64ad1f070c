"""The text-env contract, run against every registered env (see envs/base.py)."""
from __future__ import annotations

import json
import numbers

import pytest

import envs  # noqa: F401  (importing the package registers the envs)
from envs import ENVS, make_env, make_scenarios
from envs.scenarios import expert_trajectory

ENV_NAMES = sorted(name for name in ENVS if not name.startswith("_test"))
REQUIRED_INFO_KEYS = ("anchor", "action_valid", "won")


def check_info(info) -> None:
    assert isinstance(info, dict)
    missing = [k for k in REQUIRED_INFO_KEYS if k not in info]
    assert not missing, f"info lacks {missing}"
    hash(info["anchor"])
    assert isinstance(info["action_valid"], bool) and isinstance(info["won"], bool)
    if "admissible_actions" in info:
        assert all(isinstance(a, str) for a in info["admissible_actions"])


def play(name: str, seed: int, n_steps: int = 8) -> list:
    """Reset on ``seed`` and take the expert's (or the first admissible) action; the whole transcript."""
    env = make_env(name)
    obs, info = env.reset(seed=seed)
    out = [(obs, info["anchor"])]
    for _ in range(n_steps):
        action = env.expert_action() or (info.get("admissible_actions") or ["noop"])[0]
        obs, reward, terminated, truncated, info = env.step(action)
        out.append((obs, reward, terminated, truncated, info["anchor"], info["won"]))
        if terminated or truncated:
            break
    return out


def test_at_least_one_env_is_registered():
    assert "frozenlake" in ENV_NAMES


@pytest.mark.parametrize("name", ENV_NAMES)
def test_reset_and_step_types(name):
    env = make_env(name)
    obs, info = env.reset(seed=0)
    assert isinstance(obs, str) and obs
    check_info(info)
    assert isinstance(env.task_description(), str) and env.task_description()
    action = (info.get("admissible_actions") or ["noop"])[0]
    result = env.step(action)
    assert len(result) == 5
    obs, reward, terminated, truncated, info = result
    assert isinstance(obs, str)
    assert isinstance(reward, numbers.Real) and not isinstance(reward, bool)
    assert isinstance(terminated, bool) and isinstance(truncated, bool)
    check_info(info)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_invalid_text_is_an_invalid_action_not_an_error(name):
    env = make_env(name)
    env.reset(seed=0)
    _, _, _, _, info = env.step("@@ definitely not an action @@")
    assert info["action_valid"] is False


@pytest.mark.parametrize("name", ENV_NAMES)
def test_seeded_determinism(name):
    assert play(name, seed=11) == play(name, seed=11)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_scenarios_reset_deterministically(name):
    for scenario in make_scenarios(name, "train", 3, seed=0):
        first = make_env(name).reset(seed=scenario.seed, options=dict(scenario.options))
        second = make_env(name).reset(seed=scenario.seed, options=dict(scenario.options))
        assert first[0] == second[0] and first[1]["anchor"] == second[1]["anchor"]


@pytest.mark.parametrize("name", ENV_NAMES)
def test_expert_solver_wins_where_it_exists(name):
    for scenario in make_scenarios(name, "heldout", 5, seed=0):
        env = make_env(name)
        env.reset(seed=scenario.seed, options=dict(scenario.options))
        if env.expert_action() is None:
            pytest.skip(f"{name} has no expert solver")
        steps = expert_trajectory(scenario)  # raises if the expert did not win
        assert steps and all(isinstance(a, str) for _, _, a in steps)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_unknown_reset_options_are_refused(name):
    with pytest.raises(ValueError, match="valid options"):
        make_env(name).reset(seed=0, options={"no_such_option": 1})


@pytest.mark.parametrize("name", ENV_NAMES)
def test_max_steps_truncates_and_invalid_actions_count(name):
    env = make_env(name, max_steps=2)
    env.reset(seed=0)
    results = [env.step("@@ not an action @@") for _ in range(2)]
    assert all(r[4]["action_valid"] is False for r in results)
    _, _, terminated, truncated, _ = results[-1]
    assert truncated or terminated


@pytest.mark.parametrize("name", ENV_NAMES)
def test_full_verbosity_is_accepted_and_bad_verbosity_refused(name):
    obs, _ = make_env(name, verbosity="full").reset(seed=0)
    assert isinstance(obs, str) and obs
    with pytest.raises(ValueError, match="verbosity"):
        make_env(name, verbosity="loud")


@pytest.mark.parametrize("name", ENV_NAMES)
def test_optional_info_keys_keep_their_meaning(name):
    """subgoals_done never decreases and stays <= subgoals_total; tool calls are OpenAI function calls."""
    env = make_env(name)
    obs, info = env.reset(seed=3)
    done_so_far = info.get("subgoals_done")
    for _ in range(40):
        action = env.expert_action() or (info.get("admissible_actions") or ["noop"])[0]
        obs, _, terminated, truncated, info = env.step(action)
        if "subgoals_done" in info:
            assert 0 <= info["subgoals_done"] <= info["subgoals_total"]
            assert done_so_far is None or info["subgoals_done"] >= done_so_far
            done_so_far = info["subgoals_done"]
        call = info.get("tool_call")
        if call is not None:
            assert call["type"] == "function" and isinstance(json.loads(call["function"]["arguments"]), dict)
            assert call["function"]["name"] in [t["function"]["name"] for t in type(env).tools]
            assert isinstance(info["tool_success"], bool)
        if terminated or truncated:
            break
