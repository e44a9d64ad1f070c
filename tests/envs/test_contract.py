"""The text-env contract, run against every registered env (see envs/base.py)."""
from __future__ import annotations

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
