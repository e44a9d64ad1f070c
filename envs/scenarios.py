"""Scenario sets with disjoint seed spaces per split, and expert trajectories from the envs' own solvers.

Seed spaces: split number ``k`` (its index in ``SPLITS``) owns the seeds ``[k * SPLIT_SEED_RANGE,
(k + 1) * SPLIT_SEED_RANGE)``. Inside that range, ``n`` distinct offsets are drawn without replacement by a numpy
Generator seeded with ``SeedSequence([seed, k])``. So ``train`` and ``heldout`` can never share a seed (whatever
``seed`` and ``n`` are), no two scenarios of one set share a seed, and the same (env, split, n, seed) always gives
the same list.

Unseen held-out sets (``unseen_heldout``): disjoint seeds do not make disjoint content (on the default 4x4
FrozenLake with 512 train scenarios, 115 of 200 seed-drawn held-out maps are train maps). A held-out set keeps only
candidates whose content key (``scenario_content_key`` in envs/base.py) no train scenario of the env has, and drops
a candidate whose key an earlier kept one has: a repeat adds no unseen content, only a second evaluation of the same
scenario (the price: kinds with few distinct scenarios, such as rps's reactive opponents, weigh less than in the
plain draw; ``distinct=False`` keeps repeats). Candidates come from the held-out seed range
(``candidate_scenarios``: ``make_scenarios``' own list first, so a set that needs no filtering is unchanged), at
most ``MAX_CANDIDATES_PER_SCENARIO`` per requested scenario; too few unseen ones raise ``UnseenScenarioShortage``.
Pure module: no file I/O (bootstrap writes the sets to disk).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Collection, Iterable, Iterator

import numpy as np

from envs.base import (ENVS, Scenario, close_env, make_env, make_scenario_env, scenario_content_key,
                       scenario_content_keys)

SPLITS: tuple[str, ...] = ("train", "heldout")
SPLIT_SEED_RANGE = 2**31
MAX_CANDIDATES_PER_SCENARIO = 20  # unseen_heldout draws at most this many candidates per held-out scenario asked


def make_scenarios(env: str, split: str, n: int, seed: int, options: dict | None = None) -> list[Scenario]:
    """``n`` scenarios of ``env`` for ``split``: distinct seeds, inside the split's own seed range."""
    if env not in ENVS:
        raise KeyError(f"unknown env {env!r}; registered envs: {sorted(ENVS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {list(SPLITS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    offsets = _seed_offsets(seed, SPLITS.index(split), 0, n)  # [n] distinct
    return [_scenario(env, split, int(off), options) for off in offsets]


def candidate_scenarios(env: str, split: str, n: int, seed: int, options: dict | None = None
                        ) -> Iterator[Scenario]:
    """Endless distinct-seed scenarios of ``split``'s range: ``make_scenarios(env, split, n, seed, options)`` first,
    then batches of ``max(n, 1)`` drawn by ``SeedSequence([seed, split index, b])`` for b = 1, 2, ..., skipping
    seeds already given. Deterministic in its arguments."""
    first = make_scenarios(env, split, n, seed, options)
    used = {s.seed for s in first}
    yield from first
    split_index, batch = SPLITS.index(split), 1
    while len(used) < SPLIT_SEED_RANGE:
        for offset in _seed_offsets(seed, split_index, batch, max(n, 1)):
            scenario = _scenario(env, split, int(offset), options)
            if scenario.seed not in used:
                used.add(scenario.seed)
                yield scenario
        batch += 1


def _seed_offsets(seed: int, split_index: int, batch: int, n: int) -> np.ndarray:
    """``n`` distinct offsets in ``[0, SPLIT_SEED_RANGE)``; batch 0 is ``make_scenarios``' draw."""
    words = [int(seed), split_index] + ([batch] if batch else [])
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))
    return rng.choice(SPLIT_SEED_RANGE, size=n, replace=False)  # [n]


def _scenario(env: str, split: str, offset: int, options: dict | None) -> Scenario:
    options = dict(options or {})
    if getattr(ENVS[env], "split_aware", False):
        options["split"] = split
    return Scenario(env=env, seed=SPLITS.index(split) * SPLIT_SEED_RANGE + offset, split=split,
                    options=tuple(sorted(options.items())))


@dataclass(frozen=True)
class HeldoutSelection:
    """An unseen held-out set and how it was found (the counts bootstrap reports)."""

    scenarios: tuple[Scenario, ...]  # the kept candidates, in draw order
    candidates: int  # candidates drawn (keyed)
    overlap_before: int  # of the first n candidates (make_scenarios' plain draw), how many a train scenario has
    overlap: int  # kept scenarios whose key a train scenario has: 0, recounted on the result
    seen_dropped: int  # candidates dropped because a train scenario has their key
    duplicates_dropped: int  # candidates dropped because an earlier kept one has their key


class UnseenScenarioShortage(ValueError):
    """Too few unseen, distinct held-out scenarios within the candidate budget."""

    def __init__(self, env: str, needed: int, found: int, candidates: int, seen: int, duplicates: int) -> None:
        self.env, self.needed, self.found = env, needed, found
        self.candidates, self.seen, self.duplicates = candidates, seen, duplicates
        self.summary = (f"{env}: only {found} distinct unseen held-out scenarios in {candidates} candidates, {needed} "
                        f"needed ({seen} candidates repeat a train scenario, {duplicates} an earlier held-out one)")
        super().__init__(f"{self.summary}: ask for fewer held-out or train scenarios, or widen the env's scenario "
                         f"space (its kwargs, e.g. a bigger frozenlake map)")


def select_unseen(candidates: Iterable[Scenario], key: Callable[[Scenario], str], train_keys: Collection[str],
                  n: int, *, max_candidates: int, distinct: bool = True) -> HeldoutSelection:
    """The first ``n`` candidates whose ``key`` is not in ``train_keys`` (with ``distinct``, nor the key of an earlier
    kept one), looking at no more than ``max_candidates`` candidates; raises ``UnseenScenarioShortage`` when they run
    out first."""
    if n < 0 or max_candidates < 0:
        raise ValueError(f"n and max_candidates must be >= 0, got n={n}, max_candidates={max_candidates}")
    kept: list[Scenario] = []
    kept_keys: set[str] = set()
    drawn = overlap_before = seen = duplicates = 0
    env = "?"
    for scenario in candidates:
        if len(kept) >= n or drawn >= max_candidates:
            break
        env, scenario_key = scenario.env, key(scenario)
        drawn += 1
        if scenario_key in train_keys:
            seen += 1
            overlap_before += drawn <= n
        elif distinct and scenario_key in kept_keys:
            duplicates += 1
        else:
            kept.append(scenario)
            kept_keys.add(scenario_key)
    if len(kept) < n:
        raise UnseenScenarioShortage(env, n, len(kept), drawn, seen, duplicates)
    return HeldoutSelection(scenarios=tuple(kept), candidates=drawn, overlap_before=overlap_before,
                            overlap=len(kept_keys & set(train_keys)), seen_dropped=seen, duplicates_dropped=duplicates)


def unseen_heldout(env: str, train: Iterable[Scenario], n: int, seed: int, env_kwargs: dict | None = None,
                   options: dict | None = None, max_candidates: int | None = None, distinct: bool = True
                   ) -> HeldoutSelection:
    """``n`` held-out scenarios of ``env`` that no train scenario of ``env`` (those of ``train``) shares a content key
    with, and with ``distinct`` none another held-out one does (module docstring); keys are taken with
    ``env_kwargs``, the kwargs the scenarios are played with. At most ``max_candidates`` (default
    ``MAX_CANDIDATES_PER_SCENARIO * n``) candidates are drawn."""
    kwargs = dict(env_kwargs or {})
    train_keys = set(scenario_content_keys([s for s in train if s.env == env], **kwargs))
    budget = MAX_CANDIDATES_PER_SCENARIO * n if max_candidates is None else max_candidates
    instance = make_env(env, **kwargs)
    try:
        return select_unseen(candidate_scenarios(env, "heldout", n, seed, options),
                             partial(scenario_content_key, instance), train_keys, n, max_candidates=budget,
                             distinct=distinct)
    finally:
        close_env(instance)


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
