"""Non-learning baselines on a project's held-out scenarios (what evaluate writes under ``baselines``, on demand).

    .venv/bin/python benchmarks/baselines.py [--root .] [--seeds 0 1 2]

Reads the project's params.yaml (env kwargs) and data/scenarios/{train,heldout}.jsonl, and prints
envs/baselines.py's report: random (per seed), every heuristic of the held-out envs (tuned on train where it has
parameters), the train-memorizing lookup, and how many held-out scenarios equal a train one.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from envs.baselines import baseline_report
from tasks.common import env_kwargs, read_scenarios
from tasks.config import load_params
from tasks.layout import Layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("."))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    layout = Layout(args.root.resolve())
    params = load_params(layout.root / "params.yaml")
    report = baseline_report(read_scenarios(layout, "heldout"), read_scenarios(layout, "train"),
                             env_kwargs(params, layout), seeds=args.seeds)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
