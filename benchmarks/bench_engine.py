"""Rollout engine throughput: arlflow's TransformersEngine vs Hugging Face `model.generate` (the peer), same run.

    .venv/bin/python benchmarks/bench_engine.py [--batch 64] [--new-tokens 4] [--repeats 5]

Both sample the same number of new tokens for the same left-padded prompts of the tiny default model; the engine
also returns per-token log-probs (generate is asked for its logits too, to be fair). Prints tokens/s and the ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from agents.prompts import build_prompt
from envs.base import make_scenario_env
from envs.scenarios import make_scenarios
from models.build import TinyModelConfig, build_model, train_tokenizer
from models.engine import SamplingParams
from models.hf_engine import TransformersEngine


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    out = []
    for scenario in make_scenarios("frozenlake", "train", n, seed=0):
        env, obs, _ = make_scenario_env(scenario)
        out.append(tokenizer.encode(build_prompt(env.task_description(), obs), add_special_tokens=False))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    corpus = [build_prompt("Reach G without stepping on H.", "P F F F\nF H F H\nF F F H\nH F F G") + " left"] * 50
    tokenizer = train_tokenizer(corpus, 300)
    model = build_model(tokenizer, TinyModelConfig(arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384, max_position_embeddings=512), seed=0).eval()
    prompts = prompts_for(tokenizer, args.batch)
    engine = TransformersEngine(model, tokenizer, policy_version="bench")
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)

    def run_engine() -> int:
        return sum(len(g.token_ids) for g in engine.generate(prompts, sampling))

    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")

    def run_generate() -> int:
        with torch.inference_mode():
            out = model.generate(**batch, do_sample=True, max_new_tokens=args.new_tokens, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
        new = out.sequences[:, batch["input_ids"].shape[1]:]
        return int((new != tokenizer.pad_token_id).sum()) + int((new == tokenizer.eos_token_id).any(dim=1).sum())

    results = {}
    for name, fn in (("arlflow engine", run_engine), ("hf generate", run_generate)):
        fn()  # warm-up
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = fn()
            rates.append(tokens / (time.perf_counter() - start))
        results[name] = statistics.median(rates)
        print(f"{name:15s} {results[name]:10.0f} tok/s (median of {args.repeats})")
    print(f"ratio engine/generate: {results['arlflow engine'] / results['hf generate']:.2f}x")


if __name__ == "__main__":
    main()
