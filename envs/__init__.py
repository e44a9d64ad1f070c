"""Text environments: the contract and registry (base), the envs (importing them registers them), scenario sets."""
from envs.base import ENVS, Scenario, TextEnv, make_env, make_scenario_env, register_env
from envs.frozenlake import ACTIONS as FROZENLAKE_ACTIONS
from envs.frozenlake import FrozenLakeText, shortest_path_actions
from envs.scenarios import SPLITS, expert_trajectory, make_scenarios

__all__ = [
    "ENVS", "FROZENLAKE_ACTIONS", "FrozenLakeText", "SPLITS", "Scenario", "TextEnv", "expert_trajectory",
    "make_env", "make_scenario_env", "make_scenarios", "register_env", "shortest_path_actions",
]
