"""Held-out success per env: the env's expert solver, a random agent and an untrained tiny policy, one table.

    .venv/bin/python benchmarks/env_suite.py [--scenarios 100] [--envs household sokoban ...] [--seed 0]

For every registered env (or ``--envs``), ``--scenarios`` held-out scenarios, chosen as bootstrap chooses them
(``unseen_heldout``: none equal in content to one of ``--train`` train scenarios, default env kwargs), are played by:
- expert: the env's own solver (``expert_steps``, require_win=False); "-" where the env has none (holdem);
- random: a uniformly random admissible action each step (seeded); "-" for free-form envs without admissible actions
  (terminal, search_qa), where "random" has no meaning (only the observation characters are measured there);
- untrained: a tiny Qwen2 (the pipeline's bootstrap size) with a BPE tokenizer trained on that env's expert text,
  never trained: sampled at temperature 1 through the batched rollout loop (what "base" is in the pipeline).
Writes benchmarks/results/env_suite.json and prints a Markdown table (the one in the README).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

import envs  # noqa: F401  (registers every env)
from agents.demos import expert_texts
from agents.rollout import run_episodes, summarize
from envs.base import ENVS, close_env, make_scenario_env
from envs.scenarios import expert_steps, make_scenarios, unseen_heldout
from models.build import TinyModelConfig, build_model, train_tokenizer
from models.engine import SamplingParams
from models.hf_engine import TransformersEngine

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "env_suite.json"


def expert_success(scenarios) -> tuple[float | None, float]:
    wins, lengths = 0, []
    for scenario in scenarios:
        try:
            steps = expert_steps(scenario, require_win=False)
        except ValueError:  # no solver
            return None, 0.0
        lengths.append(len(steps))
        env, _, _ = make_scenario_env(scenario)
        info: dict = {}
        for step in steps:
            _, _, _, _, info = env.step(step.action)
        wins += bool(info.get("won"))
        close_env(env)
    return wins / len(scenarios), sum(lengths) / len(lengths)


def random_success(scenarios, seed: int) -> tuple[float | None, float]:
    """(success of random admissible actions, or None for free-form envs; mean observation characters)."""
    rng = random.Random(seed)
    wins, obs_chars, observations, free_form = 0, 0, 0, False
    for scenario in scenarios:
        env, obs, info = make_scenario_env(scenario)
        done = False
        while not done:
            obs_chars, observations = obs_chars + len(obs), observations + 1
            admissible = info.get("admissible_actions")
            if admissible:
                action = rng.choice(admissible)
            else:  # free-form: walk the expert's path to measure observations; success is not reported
                free_form = True
                action = env.expert_action() or "noop"
            obs, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
        wins += bool(info.get("won"))
        close_env(env)
    return (None if free_form else wins / len(scenarios)), obs_chars / max(observations, 1)


def untrained_success(name: str, scenarios, seed: int) -> dict:
    corpus_scenarios = make_scenarios(name, "train", 40, seed=seed + 1)
    try:
        corpus = [p + r for p, r in expert_texts(corpus_scenarios, require_win=False)]
    except ValueError:  # no expert: random play text is enough for a tokenizer
        corpus = [make_scenario_env(s)[1] for s in corpus_scenarios]
    tokenizer = train_tokenizer(corpus, 512)
    model = build_model(tokenizer, TinyModelConfig(arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384, max_position_embeddings=2048), seed=seed).eval()
    engine = TransformersEngine(model, tokenizer, policy_version="untrained")
    trajectories = run_episodes(engine, tokenizer, scenarios, group_size=1, progress=False, seed=seed,
                                sampling=SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed))
    return summarize(trajectories)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenarios", type=int, default=100)
    parser.add_argument("--envs", nargs="*", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=512, help="train scenarios the held-out ones must differ from")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    names = args.envs or sorted(n for n in ENVS if not n.startswith("_test"))
    rows = {}
    for name in names:
        started = time.perf_counter()
        train = make_scenarios(name, "train", args.train, seed=args.seed)
        scenarios = unseen_heldout(name, train, args.scenarios, args.seed).scenarios
        expert, expert_steps_mean = expert_success(scenarios)
        rand, obs_chars = random_success(scenarios, args.seed)
        untrained = untrained_success(name, scenarios, args.seed)
        rows[name] = {"expert_success": expert, "expert_mean_steps": expert_steps_mean, "random_success": rand,
                      "untrained_success": untrained["success_rate"],
                      "untrained_invalid_action_rate": untrained["invalid_action_rate"],
                      "mean_observation_chars": obs_chars, "mean_prompt_tokens": untrained["mean_prompt_tokens"],
                      "seconds": time.perf_counter() - started}
        print(f"{name}: {rows[name]}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"scenarios": args.scenarios, "seed": args.seed, "envs": rows}, indent=2) + "\n")
    print("\n| env | expert | random | untrained policy | expert steps | obs chars | prompt tokens |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        expert = "-" if row["expert_success"] is None else f"{row['expert_success']:.2f}"
        rand = "-" if row["random_success"] is None else f"{row['random_success']:.2f}"
        print(f"| {name} | {expert} | {rand} | {row['untrained_success']:.2f} | "
              f"{row['expert_mean_steps']:.1f} | {row['mean_observation_chars']:.0f} | "
              f"{row['mean_prompt_tokens']:.0f} |")


if __name__ == "__main__":
    main()
