"""bootstrap: scenario sets (train / heldout) and the base policy (a tiny local model, or a given HF folder)."""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

from agents.context import ContextView
from agents.rollout import expert_texts
from agents.templates import render_prompt, response_text, template_for
from envs.base import Scenario, close_env, make_scenario_env
from envs.scenarios import make_scenarios
from models.build import build_model, count_parameters, load_policy, save_policy, train_tokenizer
from skills.bank import Skill
from tasks.common import env_kwargs, pregenerate_games, seed_everything, write_json, write_scenarios
from tasks.config import Params
from tasks.skill_trials import MACRO_KEYWORD, render_slot
from tasks.layout import Layout


def tokenizer_corpus(scenarios: list[Scenario], params: Params, seed: int,
                     env_kwargs_by_env: dict[str, dict[str, Any]]) -> list[str]:
    """Text the envs produce: prompts + responses along expert episodes (half the scenarios) and random-admissible
    episodes (the rest), rendered as the rollout renders them, some with a skill slot."""
    rng = random.Random(seed)
    texts: list[str] = []
    options = {"context": params.rollout.context, "history_turns": params.rollout.history_turns,
               "env_kwargs": env_kwargs_by_env}
    for scenario in scenarios:
        skills_text = ""
        if rng.random() < 0.5:
            macro = tuple(rng.choice(("left", "right", "up", "down", "look", "open")) for _ in range(rng.randint(2, 4)))
            skills_text = render_slot([Skill(name="corpus", when_to_use="", procedure="", macro=macro)],
                                      macros=True).text
            texts.append(f" {MACRO_KEYWORD.format(index=rng.randint(1, 3))}")  # a macro call, as responses write it
        if rng.random() < 0.5:
            try:
                pairs = expert_texts([scenario], require_win=False, tool_format=params.rollout.tool_format,
                                     skills_for=lambda _query, text=skills_text: (text, []), **options)
                texts.extend(prompt + response for prompt, response in pairs)
                continue
            except ValueError:  # no expert for this env or scenario: random play below
                pass
        texts.extend(random_play_texts(scenario, rng, skills_text, env_kwargs_by_env.get(scenario.env, {})))
    return texts


def random_play_texts(scenario: Scenario, rng: random.Random, skills_text: str, env_kwargs: dict) -> list[str]:
    """Prompt + response per step of an episode that takes random admissible actions (the expert's action, or a
    junk word, where the env lists none)."""
    env, obs, info = make_scenario_env(scenario, **env_kwargs)
    template = template_for(scenario.env)
    texts = []
    try:
        for _ in range(64):
            admissible = info.get("admissible_actions") or []
            action = rng.choice(admissible) if admissible else (env.expert_action() or "look")
            prompt = render_prompt(template, env.task_description(), ContextView(), obs, admissible=admissible,
                                   skills_text=skills_text)
            texts.append(prompt + response_text(action))
            obs, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
    finally:
        close_env(env)
    return texts


def make_scenario_sets(params: Params) -> tuple[list[Scenario], list[Scenario]]:
    """(train, heldout): per env of the mix (or env.name), its own seeded sets; train shuffled across envs so any
    prefix (warm-start demos, a round's batch) mixes them."""
    cfg, seed = params.bootstrap, params.pipeline.seed
    train: list[Scenario] = []
    heldout: list[Scenario] = []
    for name in params.env.names:
        n_train = params.env.mix.get(name, cfg.train_scenarios)
        train += make_scenarios(name, "train", n_train, seed)
        heldout += make_scenarios(name, "heldout", cfg.heldout_scenarios, seed)
    if len(params.env.names) > 1:
        random.Random(seed).shuffle(train)
    return train, heldout


def run(params: Params, layout: Layout) -> dict[str, Any]:
    cfg = params.bootstrap
    seed = params.pipeline.seed
    seed_everything(seed)
    if cfg.model and not (Path(cfg.model) / "config.json").exists():  # checked before anything is written
        raise FileNotFoundError(f"bootstrap.model = {cfg.model!r} is not a Hugging Face model folder "
                                "(no config.json); set it to a folder saved with save_pretrained, or '' for "
                                "the tiny local model")
    train, heldout = make_scenario_sets(params)
    kwargs_by_env = env_kwargs(params, layout)
    pregenerate_games(train + heldout, kwargs_by_env)
    write_scenarios(layout.scenarios("train"), train)
    write_scenarios(layout.scenarios("heldout"), heldout)

    target = layout.policy("base")
    if target.exists():
        shutil.rmtree(target)
    if cfg.model:
        model, tokenizer = load_policy(Path(cfg.model))
    else:
        corpus = tokenizer_corpus(train[: cfg.tokenizer_corpus_episodes], params, seed, kwargs_by_env)
        tokenizer = train_tokenizer(corpus, cfg.vocab_size)
        model = build_model(cfg.arch, tokenizer, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                            intermediate_size=cfg.intermediate_size,
                            max_position_embeddings=cfg.max_position_embeddings, seed=seed)
    save_policy(model, tokenizer, target)
    first_prompts = []
    for scenario in heldout[:: max(1, len(heldout) // 50)]:
        env, obs, info = make_scenario_env(scenario, **kwargs_by_env.get(scenario.env, {}))
        prompt = render_prompt(template_for(scenario.env), env.task_description(), ContextView(), obs,
                               admissible=info.get("admissible_actions") or ())
        first_prompts.append(len(tokenizer.encode(prompt, add_special_tokens=False)))
    metrics = {
        "parameters": count_parameters(model),
        "vocab_size": len(tokenizer),
        "train_scenarios": len(train),
        "heldout_scenarios": len(heldout),
        "mean_prompt_tokens": sum(first_prompts) / max(len(first_prompts), 1),
    }
    write_json(layout.metrics_dir / "bootstrap.json", metrics)
    return metrics
