"""Rollout throughput: arlflow's batched multi-turn loop vs a naive loop (episodes one by one, `model.generate`).

    .venv/bin/python benchmarks/rollout_throughput.py [--envs household frozenlake] [--scenarios 8]
        [--group-size 8] [--naive-episodes 16] [--max-steps 10] [--new-tokens 8] [--threads 0]

Both sides use the same tiny Qwen2 policy (built once with `models.build`, the pipeline's bootstrap size, with a
tokenizer trained on the env's text), the same episodes (`--scenarios` held-out scenarios x `--group-size`
rollouts each, as an RL round runs them), the same prompt template and window context
(agents/templates.py, agents/context.py), the same action parser, the same sampling (temperature 1, `--new-tokens`
new tokens at most, eos ends a response) and the same env kwargs (`max_steps`).

- ours: `agents.rollout.run_episodes` over all the episodes: one batched `TransformersEngine.generate` per turn over
  every live episode (KV cache, per-token log-probs, identical prompts prefilled once), env steps in the worker pool.
- naive: for each of the first `--naive-episodes` episodes in turn (the same scenarios, G times each), every turn renders the same prompt and calls
  `model.generate(input_ids, do_sample=True, max_new_tokens=...)` for that one prompt (its KV cache, batch 1),
  decodes, parses and steps the env. It runs fewer episodes (it is slow); rates are per second, so they compare.

An untrained policy answers with junk, so most actions are invalid and episodes run to `--max-steps` on both
sides: the work per episode is the same. Prints env steps/s and generated tokens/s of both and their ratio, and
writes benchmarks/results/rollout_throughput.json: the first env's `ours_steps_per_s`, `naive_steps_per_s`, `ratio`
at the top level, every env under `by_env`.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from agents.context import get_context_manager
from agents.demos import expert_texts
from agents.rollout import env_action, run_episodes
from agents.templates import render_prompt, template_for
from envs.base import make_scenario_env
from envs.scenarios import make_scenarios
from models.build import TinyModelConfig, build_model, train_tokenizer
from models.engine import SamplingParams
from models.hf_engine import TransformersEngine

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "rollout_throughput.json"


def naive_rollout(model, tokenizer, scenarios, env_kwargs: dict, new_tokens: int) -> tuple[int, int]:
    """Episodes one by one, one `model.generate` call per turn; (env steps, generated tokens)."""
    window = get_context_manager("window")
    steps = tokens = 0
    for scenario in scenarios:
        env, obs, info = make_scenario_env(scenario, **env_kwargs)
        template = template_for(scenario.env)
        task, done = env.task_description(), False
        while not done:
            prompt = render_prompt(template, task, window([], 0), obs, admissible=info.get("admissible_actions") or ())
            input_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
            with torch.inference_mode():
                out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                     temperature=1.0, top_k=0, max_new_tokens=new_tokens,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            new = out[0, input_ids.shape[1]:].tolist()
            tokens += len(new)
            sent, _ = env_action(tokenizer.decode(new, skip_special_tokens=True), info, template)
            obs, _, terminated, truncated, info = env.step(sent)
            done = terminated or truncated
            steps += 1
    return steps, tokens


def measure(env: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    env_kwargs = {"max_steps": args.max_steps}
    scenarios = make_scenarios(env, "heldout", args.scenarios, seed=0)
    episodes = [s for s in scenarios for _ in range(args.group_size)]  # what the naive loop plays, in order
    corpus = [p + r for p, r in expert_texts(make_scenarios(env, "train", 100, seed=1))]
    tokenizer = train_tokenizer(corpus, 384)
    model = build_model(tokenizer, TinyModelConfig(arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384, max_position_embeddings=1024), seed=0).eval()
    engine = TransformersEngine(model, tokenizer, policy_version="bench")
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)

    run_episodes(engine, tokenizer, scenarios[:1], group_size=2, sampling=sampling, progress=False,
                 env_kwargs={env: env_kwargs})  # warm-up
    start = time.perf_counter()
    trajectories = run_episodes(engine, tokenizer, scenarios, group_size=args.group_size, sampling=sampling,
                                progress=False, env_kwargs={env: env_kwargs})
    ours_s = time.perf_counter() - start
    ours_steps = sum(t.num_steps for t in trajectories)
    ours_tokens = sum(t.response_tokens for t in trajectories)

    naive_rollout(model, tokenizer, episodes[:1], env_kwargs, args.new_tokens)  # warm-up
    start = time.perf_counter()
    naive_steps, naive_tokens = naive_rollout(model, tokenizer, episodes[: args.naive_episodes], env_kwargs,
                                              args.new_tokens)
    naive_s = time.perf_counter() - start
    result = {
        "env": env, "scenarios": args.scenarios, "group_size": args.group_size, "episodes": len(trajectories),
        "naive_episodes": args.naive_episodes, "max_steps": args.max_steps, "max_new_tokens": args.new_tokens,
        "ours_steps": ours_steps, "ours_seconds": ours_s, "ours_steps_per_s": ours_steps / ours_s,
        "ours_tokens_per_s": ours_tokens / ours_s,
        "naive_steps": naive_steps, "naive_seconds": naive_s, "naive_steps_per_s": naive_steps / naive_s,
        "naive_tokens_per_s": naive_tokens / naive_s,
        "mean_steps_per_episode": {"ours": ours_steps / len(trajectories), "naive": naive_steps / args.naive_episodes},
        "mean_prompt_tokens": sum(len(s.prompt_ids) for t in trajectories for s in t.steps) / max(ours_steps, 1),
    }
    result["ratio"] = result["ours_steps_per_s"] / result["naive_steps_per_s"]
    result["tokens_ratio"] = result["ours_tokens_per_s"] / result["naive_tokens_per_s"]
    print(f"{env}: ours {result['ours_steps_per_s']:8.1f} env steps/s {result['ours_tokens_per_s']:8.0f} tok/s "
          f"({ours_steps} steps, {len(trajectories)} episodes, {ours_s:.1f} s)")
    print(f"{env}: naive {result['naive_steps_per_s']:7.1f} env steps/s {result['naive_tokens_per_s']:8.0f} tok/s "
          f"({naive_steps} steps, {args.naive_episodes} episodes, {naive_s:.1f} s)")
    print(f"{env}: ratio (steps/s) {result['ratio']:.2f}x, tokens/s {result['tokens_ratio']:.2f}x, "
          f"mean prompt {result['mean_prompt_tokens']:.0f} tokens")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--envs", nargs="+", default=["household", "frozenlake"])
    parser.add_argument("--scenarios", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--naive-episodes", type=int, default=16)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    by_env = {env: measure(env, args) for env in args.envs}
    first = by_env[args.envs[0]]
    result = {**first, "by_env": by_env, "torch_threads": torch.get_num_threads(), "machine": platform.platform(),
              "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
