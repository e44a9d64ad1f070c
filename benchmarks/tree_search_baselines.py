"""Non-learning baselines on tree_search held-out trees: does searching with memory beat following the hints?

    nice -n 15 .venv/bin/python benchmarks/tree_search_baselines.py [--scenarios 500] [--seeds 0 1 2]

For every config (branching, depth, hint_accuracy, max_steps) in ``CONFIGS`` and both verbosities, plays the trees of
``make_scenarios("tree_search", "heldout", n, seed=0, options={branching, depth})`` with:

- random: a uniformly random admissible action each step (mean over ``--seeds``);
- hint_or_back: memoryless, from the current observation only: the ``high`` child, ``back`` at a dead end. It never
  leaves a wrong subtree (back at a leaf returns to a node whose hint sends it down again), so it wins only when
  every hint on the way is right (about ``hint_accuracy ** depth``);
- memoryless_best: the best memoryless rule the verbosity allows. ``short``: a stochastic rule (the ``high`` child
  with probability p, else another child uniformly; ``back`` with probability q at an inner node other than the root;
  ``back`` at a dead end), (p, q) picked on train trees from ``STOCHASTIC_GRID``, scored on the held-out ones (mean
  over ``--seeds``). ``full``: the observation-only rule on the shown visited children (the ``high`` child unless
  visited, else the first unvisited one, else back), which is the DFS expert's choice: ``full`` needs no memory;
- dfs: the env's ``expert="dfs"`` (hint-first depth-first search, knows only what the episode showed);
- oracle: the env's ``expert="oracle"`` (knows the goal; the floor on steps).

Per baseline: success rate, mean steps over all episodes (a lost one counts every step it took) and over won ones;
for dfs also the fraction of its moves that are ``back`` (what its demonstrations teach). The policies read the
observation text (random reads the admissible actions); only dfs and oracle ask the env. Writes
``benchmarks/results/tree_search_baselines.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
from pathlib import Path
from typing import Callable

from envs.base import Scenario, close_env, make_scenario_env
from envs.scenarios import make_scenarios
from envs.tree_search import TreeSearchText, dfs_move

# (branching, depth, hint_accuracy, max_steps); None is the env's default 2 * depth * branching
CONFIGS: tuple[tuple[int, int, float, int | None], ...] = (
    (3, 3, 0.8, None), (3, 4, 0.7, None), (3, 4, 0.7, 20), (3, 3, 0.7, None), (3, 3, 0.7, 20), (3, 3, 0.6, 20),
    (3, 2, 0.6, None), (4, 2, 0.6, None), (2, 3, 0.8, 20), (2, 3, 0.7, 20), (2, 3, 0.6, 20), (2, 4, 0.8, 20),
    (2, 4, 0.7, 20), (2, 4, 0.6, 20),
    (2, 3, 0.8, 25), (2, 3, 0.7, 25), (2, 3, 0.6, 25),  # 25 = 2 * (15 nodes - 1) - 3: dfs always wins
)
VERBOSITIES = ("short", "full")
STOCHASTIC_GRID = tuple(itertools.product((0.5, 0.7, 0.85, 1.0), (0.0, 0.1, 0.2, 0.35)))  # (p high, q back)
TUNE_SCENARIOS = 200  # train trees the stochastic rule's (p, q) is picked on

Policy = Callable[[TreeSearchText, str, dict], str]


def read_observation(obs: str) -> tuple[int, bool, int | None, set[int] | None]:
    """(depth of the node, at a leaf, high child, visited children or None when not shown) from the text."""
    lines = obs.split("\n")
    node = lines[0].split(",")[0].removeprefix("node ")
    depth = 0 if node == "root" else node.count("-") + 1
    leaf = lines[1] in ("dead end", "goal found")
    high = None if leaf else next(int(part.split()[0]) for part in lines[1].removeprefix("signal: ").split(", ")
                                  if part.endswith("high"))
    visited = None
    if lines[-1].startswith("visited children: "):
        listed = lines[-1].removeprefix("visited children: ").split(",")[0]
        visited = set() if listed == "-" else {int(i) for i in listed.split()}
    return depth, leaf, high, visited


def hint_or_back(env: TreeSearchText, obs: str, info: dict) -> str:
    _, leaf, high, _ = read_observation(obs)
    return "back" if leaf else f"child {high}"


def visited_rule(branching: int, depth: int) -> Policy:
    """At ``full``: the DFS move computed from the current observation's visited children."""
    def choose(env: TreeSearchText, obs: str, info: dict) -> str:
        node_depth, leaf, high, visited = read_observation(obs)
        node = (1,) * node_depth  # only its depth matters to dfs_move
        explored = set() if leaf else visited
        return dfs_move(node, branching=branching, depth=depth, high=high, explored=explored) or "back"
    return choose


def stochastic_rule(p_high: float, q_back: float, branching: int, rng: random.Random) -> Policy:
    def choose(env: TreeSearchText, obs: str, info: dict) -> str:
        node_depth, leaf, high, _ = read_observation(obs)
        if leaf or (node_depth > 0 and rng.random() < q_back):
            return "back"
        if rng.random() < p_high:
            return f"child {high}"
        return f"child {rng.choice([i for i in range(1, branching + 1) if i != high])}"
    return choose


def random_admissible(rng: random.Random) -> Policy:
    return lambda env, obs, info: rng.choice(info["admissible_actions"])


def expert(env: TreeSearchText, obs: str, info: dict) -> str:
    return env.expert_action()


def play(scenario: Scenario, kwargs: dict, policy: Policy) -> tuple[bool, int, int]:
    """(won, steps, back moves) of one episode."""
    env, obs, info = make_scenario_env(scenario, **kwargs)
    backs = 0
    try:
        while True:
            action = policy(env, obs, info)
            backs += action == "back"
            obs, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                return bool(info["won"]), int(info["steps"]), backs
    finally:
        close_env(env)


def score(scenarios: list[Scenario], kwargs: dict, policy: Policy) -> dict:
    runs = [play(s, kwargs, policy) for s in scenarios]
    won = [steps for w, steps, _ in runs if w]
    return {"success": len(won) / len(runs), "mean_steps": statistics.mean(steps for _, steps, _ in runs),
            "mean_steps_won": statistics.mean(won) if won else None,
            "back_fraction": sum(b for *_, b in runs) / sum(steps for _, steps, _ in runs)}


def mean_over_seeds(results: list[dict]) -> dict:
    out = {key: statistics.mean(r[key] for r in results) for key in ("success", "mean_steps", "back_fraction")}
    won = [r["mean_steps_won"] for r in results if r["mean_steps_won"] is not None]
    out["mean_steps_won"] = statistics.mean(won) if won else None
    out["success_per_seed"] = [r["success"] for r in results]
    return out


def run_config(branching: int, depth: int, accuracy: float, max_steps: int | None, n: int,
               seeds: list[int]) -> list[dict]:
    options = {"branching": branching, "depth": depth}
    heldout = make_scenarios("tree_search", "heldout", n, seed=0, options=options)
    train = make_scenarios("tree_search", "train", TUNE_SCENARIOS, seed=0, options=options)
    base = {"branching": branching, "depth": depth, "hint_accuracy": accuracy, "max_steps": max_steps}
    limit = max_steps if max_steps is not None else 2 * depth * branching
    rows = []
    for verbosity in VERBOSITIES:
        kwargs = {"hint_accuracy": accuracy, "max_steps": max_steps, "verbosity": verbosity}
        results = {
            "random": mean_over_seeds([score(heldout, kwargs, random_admissible(random.Random(s))) for s in seeds]),
            "hint_or_back": score(heldout, kwargs, hint_or_back),
            "dfs": score(heldout, {**kwargs, "expert": "dfs"}, expert),
            "oracle": score(heldout, {**kwargs, "expert": "oracle"}, expert),
        }
        if verbosity == "full":
            results["memoryless_best"] = {**score(heldout, kwargs, visited_rule(branching, depth)),
                                          "rule": "visited children (the DFS move from the observation)"}
        else:
            tuned = {(p, q): score(train, kwargs, stochastic_rule(p, q, branching, random.Random(0)))["success"]
                     for p, q in STOCHASTIC_GRID}
            p, q = max(tuned, key=tuned.get)
            best = mean_over_seeds([score(heldout, kwargs, stochastic_rule(p, q, branching, random.Random(s)))
                                    for s in seeds])
            results["memoryless_best"] = {**best, "rule": f"stochastic p_high={p} q_back={q}",
                                          "train_success": tuned[(p, q)]}
        rows.append({**base, "max_steps": limit, "max_steps_default": max_steps is None, "verbosity": verbosity,
                     "results": results})
    return rows


def cell(result: dict) -> str:
    return f"{result['success']:.2f} / {result['mean_steps']:4.1f}"


def print_table(rows: list[dict]) -> None:
    """One line per config: random, hint_or_back, dfs and oracle read no visited list, so their short and full
    numbers are the same; the memoryless best differs (short: stochastic rule; full: the visited-children rule)."""
    columns = ("random", "hint_or_back", "memoryless short", "memoryless full", "dfs", "oracle")
    print("success / mean steps on held-out trees (a lost episode counts all its steps)")
    print(f"{'k d acc max':<14}" + "".join(f"{name:>18}" for name in columns) + f"{'dfs back':>10}  short rule")
    by_config: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        config = (row["branching"], row["depth"], row["hint_accuracy"], row["max_steps"])
        by_config.setdefault(config, {})[row["verbosity"]] = row["results"]
    for (branching, depth, accuracy, limit), results in by_config.items():
        short, full = results["short"], results["full"]
        assert all(short[name]["success"] == full[name]["success"] for name in ("random", "hint_or_back", "dfs"))
        cells = [short["random"], short["hint_or_back"], short["memoryless_best"], full["memoryless_best"],
                 short["dfs"], short["oracle"]]
        rule = short["memoryless_best"]["rule"].removeprefix("stochastic ")
        print(f"{f'{branching} {depth} {accuracy:.1f} {limit:>3}':<14}" + "".join(f"{cell(c):>18}" for c in cells)
              + f"{short['dfs']['back_fraction']:>10.2f}  {rule}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", type=int, default=500, help="held-out trees per config")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the random policies")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tree_search_baselines.json")
    args = parser.parse_args()
    rows = [row for config in CONFIGS for row in run_config(*config, n=args.scenarios, seeds=args.seeds)]
    print_table(rows)
    args.out.write_text(json.dumps({"split": "heldout", "scenarios": args.scenarios, "scenario_seed": 0,
                                    "random_seeds": args.seeds, "tune_scenarios": TUNE_SCENARIOS,
                                    "configs": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
