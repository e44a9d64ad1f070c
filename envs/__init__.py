"""Text environments: the contract and registry (base), the envs (importing them registers them), scenario sets."""
from envs import (  # noqa: F401  (importing an env module registers it)
    countdown, faulty, holdem, household, rps, search_qa, sokoban, terminal, textworld_cooking, tree_search,
)
from envs.base import ENVS, Scenario, TextEnv, make_env, make_scenario_env, register_env
from envs.frozenlake import ACTIONS as FROZENLAKE_ACTIONS
from envs.frozenlake import FrozenLakeText, shortest_path_actions
from envs.scenarios import SPLITS, ExpertStep, expert_steps, expert_trajectory, make_scenarios

__all__ = [
    "ENVS", "FROZENLAKE_ACTIONS", "ExpertStep", "FrozenLakeText", "SPLITS", "Scenario", "TextEnv", "expert_steps",
    "expert_trajectory", "make_env", "make_scenario_env", "make_scenarios", "register_env", "shortest_path_actions",
]
