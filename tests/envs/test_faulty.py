"""The fault-injecting wrapper env (envs/faulty.py): a pass-through without faults, seeded and rate-true with them."""
from __future__ import annotations

import time

import pytest

from envs import make_env, make_scenarios
from envs.base import scenario_content_key
from envs.faulty import InjectedFault, fault_draw

ACTIONS = ["right", "down", "jump", "right", "down", "left"]


def transcript(env, seed: int) -> list:
    obs, info = env.reset(seed=seed)
    out = [(obs, info)]
    for action in ACTIONS:
        out.append(env.step(action))
        if out[-1][2] or out[-1][3]:
            break
    return out


def outcomes(env, seed: int) -> list[str]:
    """Per call of a reset and 8 invalid actions (they never end the episode): "ok" or "raised"."""
    result = []
    for call in [lambda: env.reset(seed=seed)] + [lambda i=i: env.step(f"jump {i}") for i in range(8)]:
        try:
            call()
            result.append("ok")
        except InjectedFault:
            result.append("raised")
            if len(result) == 1:
                break
    return result


def test_without_faults_it_is_the_inner_env_exactly():
    for seed in (1, 2, 3):
        assert transcript(make_env("faulty", inner_kwargs={"max_steps": 5}), seed) == \
            transcript(make_env("frozenlake", max_steps=5), seed)


def test_faults_are_seeded_by_the_call_and_follow_the_rates():
    kwargs = {"raise_rate": 0.3, "inner_kwargs": {"max_steps": 50}}
    assert [outcomes(make_env("faulty", **kwargs), s) for s in range(20)] == \
        [outcomes(make_env("faulty", **kwargs), s) for s in range(20)]
    draws = [fault_draw(0, seed, f"step {n}: 'down'") for seed in range(50) for n in range(40)]   # [2000]
    assert abs(sum(d < 0.1 for d in draws) / len(draws) - 0.1) < 0.02
    assert fault_draw(0, 7, "reset") != fault_draw(1, 7, "reset")


def test_an_injected_error_says_where_and_a_hang_returns_the_inner_result_late():
    with pytest.raises(InjectedFault, match=r"injected error in reset \(scenario seed 4, fault_seed 0"):
        make_env("faulty", raise_rate=1.0).reset(seed=4)
    env = make_env("faulty", hang_rate=1.0, hang_s=0.2)
    started = time.monotonic()
    obs, _ = env.reset(seed=4)
    assert time.monotonic() - started >= 0.2 and obs == make_env("frozenlake").reset(seed=4)[0]


def test_the_content_key_and_the_expert_never_fault():
    scenario = make_scenarios("faulty", "train", 1, seed=0)[0]
    env = make_env("faulty", raise_rate=1.0)
    assert scenario_content_key(env, scenario) == scenario_content_key(make_env("frozenlake"), scenario)
    assert env.task_description() == make_env("frozenlake").task_description()


@pytest.mark.parametrize("kwargs, message", [
    ({"inner": "faulty"}, "another registered env"),
    ({"inner": "nope"}, "another registered env"),
    ({"raise_rate": 0.7, "hang_rate": 0.5}, "sum <= 1"),
    ({"hang_s": -1}, "hang_s must be >= 0"),
])
def test_bad_settings_are_refused_with_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_env("faulty", **kwargs)
