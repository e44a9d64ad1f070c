"""Held-out success of GiGPO vs GRPO at equal rollout budget, same env, same seeds (several), same warm start.

    .venv/bin/python benchmarks/gigpo_vs_grpo.py [--seeds 0 1 2] [--rounds 3] [--scenarios 128]

For each seed: bootstrap and warm-start once, then copy that project and run the same rounds (same scenarios per
round, group size, epochs, learning rate) with train.advantage = grpo and = gigpo. Greedy evaluation on the held-out
maps. Writes benchmarks/results/gigpo_vs_grpo.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from flows.stages import run_stage_functions
from tasks.common import evaluate_policy, load_engine, read_scenarios
from tasks.config import load_params, params_to_dict, parse_params
from tasks.layout import Layout

RESULTS = Path(__file__).resolve().parent / "results" / "gigpo_vs_grpo.json"
REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scenarios", type=int, default=128)
    args = parser.parse_args()
    base = params_to_dict(load_params(REPO / "params.yaml"))
    results: dict = {"config": {"rounds": args.rounds, "scenarios_per_round": args.scenarios,
                                "group_size": base["rollout"]["group_size"], "seeds": args.seeds}, "seeds": {}}
    work = Path(tempfile.mkdtemp(prefix="gigpo_vs_grpo_"))
    for seed in args.seeds:
        raw = {**base, "pipeline": {**base["pipeline"], "rounds": args.rounds, "seed": seed},
               "rollout": {**base["rollout"], "scenarios_per_round": args.scenarios, "use_skills": False}}
        shared = Layout(work / f"seed{seed}")
        run_stage_functions(parse_params(raw), shared, include=("bootstrap", "warmstart"))
        heldout = read_scenarios(shared, "heldout")
        row = {"warmstart": evaluate_policy(load_engine(shared.policy("warmstart"), "warmstart", "warmstart"),
                                            heldout, parse_params(raw))[0]["success_rate"]}
        for advantage in ("grpo", "gigpo"):
            project = Layout(work / f"seed{seed}-{advantage}")
            shutil.copytree(shared.root, project.root)
            params = parse_params({**raw, "train": {**raw["train"], "advantage": {**raw["train"]["advantage"], "name": advantage}}})
            started = time.perf_counter()
            run_stage_functions(params, project, include=("rollout", "validate", "train"))
            engine = load_engine(project.policy(f"round_{args.rounds}"), advantage, advantage)
            row[advantage] = evaluate_policy(engine, heldout, params)[0]["success_rate"]
            row[f"{advantage}_wall_s"] = round(time.perf_counter() - started, 1)
        results["seeds"][str(seed)] = row
        print(f"seed {seed}: {row}", flush=True)
    for key in ("warmstart", "grpo", "gigpo"):
        results[f"mean_{key}"] = statistics.mean(r[key] for r in results["seeds"].values())
    results["gigpo_minus_grpo"] = results["mean_gigpo"] - results["mean_grpo"]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"mean held-out success: warmstart {results['mean_warmstart']:.3f}, grpo {results['mean_grpo']:.3f}, "
          f"gigpo {results['mean_gigpo']:.3f} (gigpo - grpo = {results['gigpo_minus_grpo']:+.3f}) -> {RESULTS}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
