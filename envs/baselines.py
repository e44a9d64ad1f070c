"""Non-learning baselines: the numbers a policy's held-out success is read next to.

- ``random``: a uniformly random admissible action every step (mean and per-seed values over seeds);
- heuristics (``HEURISTICS``, per env): simple rules that read only the task, the current observation and the
  admissible actions (no env internals, no learning). An env may have several; rules with free parameters are
  tuned on train scenarios only (``tune``), then scored on the held-out ones;
- ``train_lookup``: a memorizer: on a held-out scenario whose content equals a train scenario's (scenario content
  keys, envs/base.py) it replays the expert, as if it had learned that scenario by heart; elsewhere it plays the
  best heuristic. With held-out content disjoint from train (bootstrap's default), it equals the best heuristic.

The evaluate stage writes the report into metrics/evaluate.json (``baselines``). Pure module: no Prefect, MLflow,
DVC or file I/O.
"""
from __future__ import annotations

import itertools
import random
import re
import statistics
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Mapping, Sequence

from envs.base import Scenario, close_env, make_scenario_env, scenario_content_keys

Policy = Callable[[str, str, Sequence[str], int], str]
"""(task, observation, admissible actions, turn) -> action; one fresh policy per episode."""


@dataclass(frozen=True)
class Heuristic:
    """A rule: ``make(rng, **params)`` returns a fresh episode policy; ``grid`` lists parameter settings tuned on
    train scenarios (empty: no parameters)."""

    make: Callable[..., Policy]
    grid: tuple[dict[str, Any], ...] = ()
    doc: str = ""


# ------------------------------------------------------------------------------------------------ frozenlake
_MOVES = {"down": (1, 0), "right": (0, 1), "left": (0, -1), "up": (-1, 0)}


def down_right_move(observation: str) -> str:
    """Toward G (bottom right) without memory: down or right, whichever has more of the way left, never into a
    hole or off the grid; left or up only when both are blocked."""
    grid = [line.split() for line in observation.strip().splitlines() if line.strip()]
    row, col = next(((r, c) for r, cells in enumerate(grid) for c, cell in enumerate(cells) if cell == "P"), (0, 0))

    def free(move: str) -> bool:
        r, c = row + _MOVES[move][0], col + _MOVES[move][1]
        return 0 <= r < len(grid) and 0 <= c < len(grid[r]) and grid[r][c] != "H"

    toward = ["down", "right"] if len(grid) - 1 - row >= len(grid[0]) - 1 - col else ["right", "down"]
    return next((move for move in toward + ["left", "up"] if free(move)), "down")


# ---------------------------------------------------------------------------------------------- tree_search
def read_tree_observation(observation: str) -> tuple[int, bool, int | None]:
    """(depth of the node, at a leaf, the high child) from a tree_search observation."""
    lines = observation.split("\n")
    node = lines[0].split(",")[0].removeprefix("node ")
    depth = 0 if node == "root" else node.count("-") + 1
    leaf = len(lines) < 2 or lines[1] in ("dead end", "goal found")
    high = None if leaf else next((int(part.split()[0]) for part in lines[1].removeprefix("signal: ").split(", ")
                                   if part.endswith("high")), None)
    return depth, leaf, high


def _tree_rule(rng: random.Random, p_high: float = 1.0, q_back: float = 0.0) -> Policy:
    """The high child with probability p_high (else another child), back with probability q_back at an inner node
    below the root, back at a dead end."""
    def choose(task: str, observation: str, admissible: Sequence[str], turn: int) -> str:
        depth, leaf, high = read_tree_observation(observation)
        children = [a for a in admissible if a.startswith("child ")]
        if leaf or not children or (depth > 0 and rng.random() < q_back):
            return "back"
        wanted = f"child {high}"
        if wanted in children and rng.random() < p_high:
            return wanted
        others = [a for a in children if a != wanted]
        return rng.choice(others or children)
    return choose


# ------------------------------------------------------------------------------------------------ household
def _household_rule(rng: random.Random) -> Policy:
    """Take the task's object when seen; carrying it, go to a receptacle of the goal's type (any instance) and put
    it there; otherwise visit receptacles in turn."""
    def choose(task: str, observation: str, actions: Sequence[str], turn: int) -> str:
        words = re.findall(r"[a-z]+", task.lower())
        target = words[-1] if words else ""
        obj = next((a.split()[1] for a in actions if a.startswith("take ") and a.split()[1] in words), None)
        if obj:
            return next(a for a in actions if a.startswith(f"take {obj}"))
        put = [a for a in actions if a.startswith("put ") and a.split()[-2] == target]
        if put:
            return put[0]
        goes = [a for a in actions if a.startswith("go to ")]
        carrying = any(a.startswith("put ") for a in actions)
        targets = [a for a in goes if a.split()[2] == target] if carrying else []
        options = targets or goes or list(actions)
        return options[turn % len(options)]
    return choose


HEURISTICS: dict[str, dict[str, Heuristic]] = {
    "frozenlake": {"down_right_rule": Heuristic(lambda rng: lambda t, o, a, n: down_right_move(o),
                                                doc="memoryless: down or right toward G, around holes")},
    "tree_search": {
        "hint_or_back": Heuristic(lambda rng: _tree_rule(rng), doc="memoryless: the high child, back at a dead end"),
        "hint_stochastic": Heuristic(
            _tree_rule, grid=tuple({"p_high": p, "q_back": q}
                                   for p, q in itertools.product((0.5, 0.7, 0.85, 1.0), (0.0, 0.1, 0.2, 0.35))),
            doc="memoryless, stochastic: the high child with probability p, back with probability q (tuned on "
                "train)"),
    },
    "household": {"visit_take_put": Heuristic(_household_rule, doc="take the task's object when seen, put it in a "
                                                                   "receptacle of the goal's type, else visit "
                                                                   "receptacles in turn (no memory but the turn)")},
}


def _random_policy(rng: random.Random) -> Policy:
    return lambda task, observation, admissible, turn: rng.choice(list(admissible)) if admissible else "look"


def play(scenario: Scenario, env_kwargs: Mapping[str, Mapping[str, Any]], policy: Policy | None,
         max_turns: int = 1000) -> bool:
    """One episode of ``policy`` (None: the env's expert); whether it was won."""
    env, observation, info = make_scenario_env(scenario, **dict(env_kwargs.get(scenario.env, {})))
    try:
        task = env.task_description()
        for turn in range(max_turns):
            admissible = list(info.get("admissible_actions") or [])
            action = env.expert_action() if policy is None else policy(task, observation, admissible, turn)
            if action is None:
                return bool(info.get("won", False))
            observation, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                return bool(info.get("won", False))
        return False
    finally:
        close_env(env)


def _success(scenarios: Sequence[Scenario], env_kwargs, make: Callable[[Scenario, random.Random], Policy | None],
            seed: int, max_turns: int = 1000) -> float:
    rng = random.Random(seed)
    return (sum(play(s, env_kwargs, make(s, rng), max_turns) for s in scenarios) / len(scenarios)
            if scenarios else 0.0)


def _spread(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.mean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
            "per_seed": values}


def baseline_report(heldout: Sequence[Scenario], train: Sequence[Scenario],
                    env_kwargs: Mapping[str, Mapping[str, Any]] | None = None, *, seeds: Iterable[int] = (0, 1, 2),
                    tune_scenarios: int = 100, max_turns: int = 1000) -> dict[str, Any]:
    """random, every heuristic of the held-out envs (tuned on train where it has a grid), and train_lookup, on
    ``heldout``; with how many held-out scenarios equal a train scenario in content. Each plays at most
    ``max_turns`` primitive actions per episode (the policies' decision budget; baselines have no macros)."""
    env_kwargs = env_kwargs or {}
    success = partial(_success, max_turns=max_turns)
    seeds = list(seeds)
    heldout, train = list(heldout), list(train)
    kwargs = lambda s: dict(env_kwargs.get(s.env, {}))  # noqa: E731
    train_keys = set()
    for env in {s.env for s in train}:
        train_keys |= set(scenario_content_keys([s for s in train if s.env == env], **dict(env_kwargs.get(env, {}))))
    heldout_keys = {id(s): scenario_content_keys([s], **kwargs(s))[0] for s in heldout}
    seen = [s for s in heldout if heldout_keys[id(s)] in train_keys]
    report: dict[str, Any] = {"heldout_scenarios": len(heldout), "heldout_equal_to_a_train_scenario": len(seen),
                              "seeds": seeds}
    report["random"] = _spread([success(heldout, env_kwargs, lambda s, rng: _random_policy(rng), seed)
                                for seed in seeds])
    heuristics: dict[str, Any] = {}
    best_for_env: dict[str, tuple[float, Heuristic, dict]] = {}
    for env in sorted({s.env for s in heldout}):
        env_heldout = [s for s in heldout if s.env == env]
        env_train = [s for s in train if s.env == env][:tune_scenarios]
        for name, rule in HEURISTICS.get(env, {}).items():
            params: dict[str, Any] = {}
            if rule.grid and env_train:
                params = max(rule.grid, key=lambda p: success(env_train, env_kwargs,
                                                              lambda s, rng: rule.make(rng, **p), seeds[0]))
            values = [success(env_heldout, env_kwargs, lambda s, rng: rule.make(rng, **params), seed)
                      for seed in seeds]
            heuristics[f"{env}/{name}" if len({s.env for s in heldout}) > 1 else name] = {
                **_spread(values), "params": params, "rule": rule.doc}
            if env not in best_for_env or statistics.mean(values) > best_for_env[env][0]:
                best_for_env[env] = (statistics.mean(values), rule, params)
    report["heuristics"] = heuristics
    if heuristics:
        best = max(heuristics, key=lambda name: heuristics[name]["mean"])
        report["best_heuristic"] = {"name": best, "mean": heuristics[best]["mean"]}

    def lookup(scenario: Scenario, rng: random.Random) -> Policy | None:
        if heldout_keys[id(scenario)] in train_keys:
            return None                                                      # memorized: replay the solution
        if scenario.env in best_for_env:
            _, rule, params = best_for_env[scenario.env]
            return rule.make(rng, **params)
        return _random_policy(rng)

    report["train_lookup"] = _spread([success(heldout, env_kwargs, lookup, seed) for seed in seeds])
    return report
