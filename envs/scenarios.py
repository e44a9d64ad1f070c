"""Scenario sets with disjoint seed spaces per split, and expert trajectories from the envs' own solvers.

Seed spaces: split number ``k`` (its index in ``SPLITS``) owns the seeds ``[k * SPLIT_SEED_RANGE,
(k + 1) * SPLIT_SEED_RANGE)``. Inside that range, ``n`` distinct offsets are drawn without replacement by a numpy
Generator seeded with ``SeedSequence([seed, k])``. So ``train`` and ``heldout`` can never share a seed (whatever
``seed`` and ``n`` are), no two scenarios of one set share a seed, and the same (env, split, n, seed) always gives
the same list. Pure module: no file I/O (bootstrap writes the sets to disk).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.base import ENVS, Scenario, close_env, make_scenario_env

SPLITS: tuple[str, ...] = ("train", "heldout")
SPLIT_SEED_RANGE = 2**31


def make_scenarios(env: str, split: str, n: int, seed: int, options: dict | None = None) -> list[Scenario]:
    """``n`` scenarios of ``env`` for ``split``: distinct seeds, inside the split's own seed range."""
    if env not in ENVS:
        raise KeyError(f"unknown env {env!r}; registered envs: {sorted(ENVS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {list(SPLITS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    split_index = SPLITS.index(split)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), split_index])))
    offsets = rng.choice(SPLIT_SEED_RANGE, size=n, replace=False)  # [n] distinct
    options = dict(options or {})
    if getattr(ENVS[env], "split_aware", False):
        options["split"] = split
    frozen_options = tuple(sorted(options.items()))
    return [Scenario(env=env, seed=split_index * SPLIT_SEED_RANGE + int(off), split=split, options=frozen_options)
            for off in offsets]


@dataclass(frozen=True)
class ExpertStep:
    """One step of an expert episode: what the agent saw (task, observation, info) and what the expert did."""

    task: str
    observation: str
    info: dict
    action: str


def expert_steps(scenario: Scenario, *, require_win: bool = True, **env_kwargs: Any) -> list[ExpertStep]:
    """The env's expert solver played from reset until the episode ends, one ExpertStep per step.

    Raises ValueError if the solver has no action at the start (unsolvable scenario, or an env without a solver),
    or, with ``require_win``, if following it did not win (e.g. ``max_steps`` shorter than the path, or a slippery
    lake that slid the agent into a hole).
    """
    env, obs, info = make_scenario_env(scenario, **env_kwargs)
    try:
        task = env.task_description()
        steps: list[ExpertStep] = []
        done = False
        while not done:
            action = env.expert_action()
            if action is None:
                if not steps:
                    raise ValueError(f"scenario {scenario.scenario_id} is unsolvable by the {scenario.env} expert "
                                     f"solver (no path to the goal, or the env has no solver): drop it from the set")
                break
            steps.append(ExpertStep(task, obs, info, action))
            obs, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
    finally:
        close_env(env)
    if require_win and not info.get("won", False):
        raise ValueError(f"the expert did not win scenario {scenario.scenario_id} in {len(steps)} steps "
                         f"(env kwargs {env_kwargs}): raise max_steps, use a non-slippery env, or pass "
                         f"require_win=False to keep losing demonstrations")
    return steps


def expert_trajectory(scenario: Scenario, *, require_win: bool = True,
                      **env_kwargs: Any) -> list[tuple[str, str, str]]:
    """(task, observation, action) per step of ``expert_steps`` (same errors)."""
    return [(s.task, s.observation, s.action) for s in expert_steps(scenario, require_win=require_win, **env_kwargs)]
