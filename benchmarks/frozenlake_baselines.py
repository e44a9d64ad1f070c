"""Non-learning baselines on a project's FrozenLake held-out set, next to which its policies' numbers are read.

    .venv/bin/python benchmarks/frozenlake_baselines.py [--root .] [--seeds 0 1 2]

Plays every held-out scenario of ``data/scenarios/heldout.jsonl`` (with the project's ``env.kwargs.frozenlake``)
with:
- random: a uniformly random move each step (mean over ``--seeds``);
- down-right rule: memoryless, steps down or right toward G (whichever has more of the way left), never into a hole
  or off the grid, left or up only when both are blocked;
- train lookup: the expert's moves where the map is one of the train maps (memorized), else the rule above.
Reports success per baseline, and how many held-out maps equal a train map (bootstrap makes that 0).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import yaml

from envs.base import Scenario, close_env, make_scenario_env
from tasks.sections import FROZENLAKE_DEFAULTS

FROZENLAKE_DEFAULTS_BY_ENV = {"frozenlake": FROZENLAKE_DEFAULTS}

MOVES = {"down": (1, 0), "right": (0, 1), "left": (0, -1), "up": (-1, 0)}


def grid_of(observation: str) -> list[list[str]]:
    return [line.split() for line in observation.strip().splitlines() if line.strip()]


def rule_move(observation: str) -> str:
    """Toward G (bottom right) without memory: down or right, whichever has more of the way left, never into a hole
    or off the grid; left or up only when both are blocked. (Of the simple rules tried it is the strongest: down
    first, else right, scored 0.735 / 0.655 on the old / unseen held-out sets against 0.92 / 0.83 for this one.)"""
    grid = grid_of(observation)
    row, col = next((r, c) for r, cells in enumerate(grid) for c, cell in enumerate(cells) if cell == "P")

    def free(move: str) -> bool:
        r, c = row + MOVES[move][0], col + MOVES[move][1]
        return 0 <= r < len(grid) and 0 <= c < len(grid[0]) and grid[r][c] != "H"

    toward = ["down", "right"] if len(grid) - 1 - row >= len(grid[0]) - 1 - col else ["right", "down"]
    return next((move for move in toward + ["left", "up"] if free(move)), "down")


def play(scenario: Scenario, kwargs: dict, policy) -> bool:
    env, obs, info = make_scenario_env(scenario, **kwargs)
    try:
        for turn in range(100):
            obs, _, terminated, truncated, info = env.step(policy(env, obs, turn))
            if terminated or truncated:
                return bool(info.get("won"))
        return False
    finally:
        close_env(env)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=Path("."))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    # only env.kwargs is read (so projects written by older arlflow versions work too)
    raw = yaml.safe_load((args.root / "params.yaml").read_text()) or {}
    kwargs = ((raw.get("env") or {}).get("kwargs") or FROZENLAKE_DEFAULTS_BY_ENV).get("frozenlake", {})
    read = lambda split: [Scenario.from_json(line) for line in  # noqa: E731
                          (args.root / "data" / "scenarios" / f"{split}.jsonl").read_text().splitlines() if line]
    train, heldout = read("train"), read("heldout")
    first = lambda s: make_scenario_env(s, **kwargs)[1]  # noqa: E731 - the map, the agent on S
    train_maps = {first(s) for s in train}
    heldout_maps = [first(s) for s in heldout]

    def lookup(env, obs, turn):  # the expert's move on a memorized map, the rule elsewhere
        return env.expert_action() if heldout_maps[current[0]] in train_maps else rule_move(obs)

    results = {"heldout": len(heldout), "heldout_maps_equal_to_a_train_map": sum(m in train_maps for m in heldout_maps)}
    randoms = []
    for seed in args.seeds:
        rng = random.Random(seed)
        randoms.append(sum(play(s, kwargs, lambda e, o, t: rng.choice(list(MOVES))) for s in heldout) / len(heldout))
    results["random"] = {"mean": statistics.mean(randoms), "per_seed": randoms}
    results["down_right_rule"] = sum(play(s, kwargs, lambda e, o, t: rule_move(o)) for s in heldout) / len(heldout)
    wins = 0
    current = [0]
    for index, scenario in enumerate(heldout):
        current[0] = index
        wins += play(scenario, kwargs, lookup)
    results["train_lookup_else_rule"] = wins / len(heldout)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
