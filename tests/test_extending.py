"""Extending arlflow is one place each (README "Extending arlflow"): a registered estimator, filter or env is usable
from params.yaml with no other edit, and a new knob is one dataclass field the loader reads and checks."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import pytest
import torch

from datapool.filters import FILTERS, FilterConfig, apply_filters
from envs.base import ENVS, make_scenario_env, register_env
from envs.scenarios import make_scenarios
from models.advantages import ADVANTAGES, AdvantageResult, broadcast_rows
from models.checks import check_config
from tasks.config import ParamsError, build_config, parse_params
from tasks.train import step_batch, training_rows


def steps_frame(rewards: list[float]) -> pd.DataFrame:
    return pd.DataFrame({
        "trajectory_id": [f"t{i}" for i in range(len(rewards))], "group_id": ["g"] * len(rewards),
        "step_index": [0] * len(rewards), "reward": rewards, "anchor": ["s"] * len(rewards),
        "won": [r > 0 for r in rewards], "action_valid": [True] * len(rewards),
        "prompt_ids": [[1, 2]] * len(rewards), "response_ids": [[3]] * len(rewards),
        "logprobs": [[-0.5]] * len(rewards), "process_reward": [0.0] * len(rewards),
        "episode_return": rewards, "status": ["complete"] * len(rewards)})


@pytest.fixture
def sign_estimator():
    @ADVANTAGES.register("sign")
    def sign(batch, cfg) -> AdvantageResult:
        """A = sign(reward) on every token: a toy estimator."""
        rows = torch.sign(batch.rewards)                                    # [R]
        return AdvantageResult(broadcast_rows(rows, batch.response_mask), rows, {"sign_mean": float(rows.mean())})

    yield sign
    ADVANTAGES.unregister("sign")


def test_a_registered_estimator_is_selected_by_params_alone(sign_estimator):
    params = parse_params({"train": {"advantage": "sign"}})
    rows, metrics, _ = training_rows(steps_frame([1.0, -2.0, 0.0]), params.train, tokenizer=None)
    assert [r.advantage for r in rows] == [[1.0], [-1.0], [0.0]] and metrics["sign_mean"] == 0.0
    assert step_batch(steps_frame([1.0])).rewards.tolist() == [1.0]


@pytest.fixture
def drop_losers():
    @FILTERS.register("drop_losers")
    def drop(frame: pd.DataFrame, cfg: FilterConfig):
        kept = frame[frame["episode_return"] > 0]
        return kept, {"drop_losers_dropped_steps": len(frame) - len(kept)}

    yield drop
    FILTERS.unregister("drop_losers")


def test_a_registered_filter_is_selected_by_params_alone(drop_losers):
    cfg = parse_params({"train": {"filters": {"names": ["drop_losers"]}}}).train.filters
    kept, stats = apply_filters(steps_frame([1.0, -1.0, 2.0]), cfg)
    assert kept["trajectory_id"].tolist() == ["t0", "t2"] and stats["drop_losers_dropped_steps"] == 1


class CoinEnv:
    """Guess the hidden side of a coin: one step, reward 1 if right."""

    def __init__(self, *, max_steps: int = 1, verbosity: str = "short") -> None:
        self.max_steps, self.verbosity = max_steps, verbosity

    def task_description(self) -> str:
        return "Guess heads or tails."

    def reset(self, *, seed=None, options=None):
        self.side = "heads" if (seed or 0) % 2 == 0 else "tails"
        return "A coin is flipped.", {"anchor": "start", "admissible_actions": ["heads", "tails"], "won": False,
                                      "action_valid": True}

    def step(self, action: str):
        won = action.strip() == self.side
        return "Done.", float(won), True, False, {"anchor": "end", "won": won, "action_valid": True}


@pytest.fixture
def coin_env():
    register_env("coin")(CoinEnv)
    yield CoinEnv
    ENVS.pop("coin")


def test_a_registered_env_is_selected_by_params_alone(coin_env):
    params = parse_params({"env": {"name": "coin", "kwargs": {"coin": {"max_steps": 1}}}})
    assert params.env.names == ("coin",)
    scenario = make_scenarios("coin", "train", 2, seed=0)[0]
    env, obs, info = make_scenario_env(scenario, **params.env.kwargs["coin"])
    assert obs == "A coin is flipped." and env.step(env.side)[1] == 1.0
    with pytest.raises(ParamsError, match="env.kwargs.coin has unknown key"):
        parse_params({"env": {"name": "coin", "kwargs": {"coin": {"sides": 3}}}})


def test_a_new_knob_is_one_field_that_the_loader_reads_and_checks():
    @dataclass(frozen=True)
    class WidgetConfig:
        """A component's config."""

        width: int = 3
        """How wide."""

        def __post_init__(self) -> None:
            check_config(self, width="positive")

    assert build_config(WidgetConfig, {"width": 5}, "widget").width == 5
    with pytest.raises(ParamsError, match=r"widget.width = 0: must be > 0"):
        build_config(WidgetConfig, {"width": 0}, "widget")
    with pytest.raises(ParamsError, match=r"unknown key\(s\) \['height'\] in widget; valid keys: \['width'\]"):
        build_config(WidgetConfig, {"height": 1}, "widget")
