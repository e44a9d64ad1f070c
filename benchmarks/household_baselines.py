"""Non-learning baselines on a project's held-out household scenarios (e.g. the SmolLM2 profile's).

    .venv/bin/python benchmarks/household_baselines.py --root PROJECT [--seeds 0 1 2 3 4]

- random: a uniformly random admissible action each step (seeds given);
- heuristic: go to each receptacle in turn and take the task's object when seen, then go to the target and put it
  (uses only the task text and the admissible actions, no env internals);
The env kwargs are the project's params (env.kwargs.household). Prints the success rates.
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
from pathlib import Path

from envs.base import close_env, make_scenario_env
from tasks.common import env_kwargs, read_scenarios
from tasks.config import load_params
from tasks.layout import Layout


def play(scenario, kwargs, choose) -> bool:
    env, obs, info = make_scenario_env(scenario, **kwargs)
    try:
        task = env.task_description()
        for turn in range(1000):
            action = choose(task, obs, list(info.get("admissible_actions") or ["look"]), turn)
            obs, reward, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                return bool(info.get("won", reward > 0))
        return False
    finally:
        close_env(env)


def heuristic(task: str, obs: str, actions: list[str], turn: int) -> str:
    words = re.findall(r"[a-z]+", task.lower())
    obj = next((a.split()[1] for a in actions if a.startswith("take ") and a.split()[1] in words), None)
    if obj:
        return next(a for a in actions if a.startswith(f"take {obj}"))
    put = [a for a in actions if a.startswith("put ") and any(w in a.split()[-2] for w in words[-2:])]
    if put:
        return put[0]
    goes = [a for a in actions if a.startswith("go to ")]
    targets = [a for a in goes if any(w in a for w in words[-2:])] if " 1" in obs and "You pick up" in obs else []
    return (targets or goes or actions)[turn % len(targets or goes or actions)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    args = parser.parse_args()
    layout = Layout(args.root.resolve())
    params = load_params(args.root / "params.yaml") if (args.root / "params.yaml").exists() else None
    kwargs = env_kwargs(params, layout).get("household", {}) if params else {}
    heldout = read_scenarios(layout, "heldout")
    rates = []
    for seed in args.seeds:
        rng = random.Random(seed)
        rates.append(sum(play(s, kwargs, lambda t, o, a, n: rng.choice(a)) for s in heldout) / len(heldout))
    rule = sum(play(s, kwargs, heuristic) for s in heldout) / len(heldout)
    print(f"{len(heldout)} held-out scenarios, env kwargs {kwargs}")
    print(f"random admissible: mean {statistics.mean(rates):.3f} (min {min(rates):.3f}, max {max(rates):.3f}, "
          f"seeds {args.seeds})")
    print(f"heuristic (visit receptacles, take the task's object, put it at the target): {rule:.3f}")


if __name__ == "__main__":
    main()
