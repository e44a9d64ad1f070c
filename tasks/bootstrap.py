"""bootstrap: scenario sets (train / heldout) and the base policy (a tiny local model, or a given HF folder)."""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

from agents.prompts import build_prompt, response_text
from envs.base import Scenario, make_scenario_env
from envs.scenarios import make_scenarios
from models.build import build_model, count_parameters, load_policy, save_policy, train_tokenizer
from skills.bank import Skill
from skills.retrieval import render_skills
from tasks.common import env_kwargs, seed_everything, write_json, write_scenarios
from tasks.config import Params
from tasks.layout import Layout

ACTION_WORDS = ("left", "down", "right", "up")


def tokenizer_corpus(scenarios: list[Scenario], params: Params, seed: int) -> list[str]:
    """Text the envs produce: prompts along expert and random episodes, action responses, skill slots."""
    rng = random.Random(seed)
    texts: list[str] = []
    for scenario in scenarios:
        env, obs, info = make_scenario_env(scenario, **env_kwargs(params.env))
        expert = rng.random() < 0.5
        skills_text = ""
        if rng.random() < 0.5:
            macro = tuple(rng.choice(ACTION_WORDS) for _ in range(rng.randint(2, 4)))
            skills_text = render_skills([Skill(name="corpus", when_to_use="", procedure="", macro=macro)])
        for _ in range(params.env.max_steps):
            action = (env.expert_action() if expert else None) or rng.choice(ACTION_WORDS)
            texts.append(build_prompt(env.task_description(), obs, skills_text=skills_text) + response_text(action))
            obs, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
    return texts


def run(params: Params, layout: Layout) -> dict[str, Any]:
    cfg = params.bootstrap
    seed = params.pipeline.seed
    seed_everything(seed)
    if cfg.model and not (Path(cfg.model) / "config.json").exists():  # checked before anything is written
        raise FileNotFoundError(f"bootstrap.model = {cfg.model!r} is not a Hugging Face model folder "
                                "(no config.json); set it to a folder saved with save_pretrained, or '' for "
                                "the tiny local model")
    options: dict = {}
    train = make_scenarios(params.env.name, "train", cfg.train_scenarios, seed, options)
    heldout = make_scenarios(params.env.name, "heldout", cfg.heldout_scenarios, seed, options)
    write_scenarios(layout.scenarios("train"), train)
    write_scenarios(layout.scenarios("heldout"), heldout)

    target = layout.policy("base")
    if target.exists():
        shutil.rmtree(target)
    if cfg.model:
        model, tokenizer = load_policy(Path(cfg.model))
    else:
        corpus = tokenizer_corpus(train[: cfg.tokenizer_corpus_episodes], params, seed)
        tokenizer = train_tokenizer(corpus, cfg.vocab_size)
        model = build_model(cfg.arch, tokenizer, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                            intermediate_size=cfg.intermediate_size,
                            max_position_embeddings=cfg.max_position_embeddings, seed=seed)
    save_policy(model, tokenizer, target)
    first_prompts = []
    for scenario in heldout[:50]:
        env, obs, _ = make_scenario_env(scenario, **env_kwargs(params.env))
        first_prompts.append(len(tokenizer.encode(build_prompt(env.task_description(), obs), add_special_tokens=False)))
    metrics = {
        "parameters": count_parameters(model),
        "vocab_size": len(tokenizer),
        "train_scenarios": len(train),
        "heldout_scenarios": len(heldout),
        "mean_prompt_tokens": sum(first_prompts) / max(len(first_prompts), 1),
    }
    write_json(layout.metrics_dir / "bootstrap.json", metrics)
    return metrics
